"""Group Relative Policy Optimization on LoRA: the clipped policy-gradient loss of TRL's GRPOTrainer
(and its variants: DAPO, Dr. GRPO, BNPO; GSPO's sequence-level importance sampling) as one loss module.

The rollout samples completions with the policy, scores them, turns the rewards of each prompt's
group into advantages and hands them here with the completions' old and reference per-token
log-probabilities. Every engine trains this module the way it trains the
SFT loss: the peft model, and a forward that returns the step's share of the loss. A micro-batch
holds completions (each after its prompt) packed into rows like SFT samples, or one per row; the
head and log-softmax run chunk by chunk over the completion tokens only (`token_log_probs`), so the
[tokens x vocab] logits never exist, and the per-token entropy comes out of the same pass.

The formulas are TRL's (`GRPOTrainer._compute_loss`): each token's importance ratio against the
policy that sampled it (or its sequence's, length-averaged in log space, for GSPO), clipped to
[1 - epsilon, 1 + epsilon_high], times the advantage, plus beta x the k3 estimate of the KL to the
reference. Their reductions differ in what they divide by: per sequence then over sequences (grpo),
over the micro-batch's tokens (bnpo), over a fixed max_new_tokens per sequence (dr_grpo), over the
step's tokens (dapo). TRL divides each micro-batch's loss by the accumulation steps; here the
sequences of the whole step (all ranks, all micro-batches) stand in for that, and dapo's tokens of
the step are the same as TRL's, so a step equals TRL's on the same completions
(tests/training/objectives/test_grpo.py), packed or not, and the metrics carry TRL's names.

With one optimisation step per generation the sampling policy is the current one: its
log-probabilities are this forward's own, detached (TRL's num_iterations == 1 path), so the ratio is
1 and the loss's gradient is the plain policy gradient. The rollout's scoring passes (the old policy
when a generation is reused, the reference) go through this module too (`recorded`), so every
engine scores the way it trains.

When vLLM samples (`--rollout vllm`), its log-probabilities differ from the trainer's by numerics
(other kernels, another precision, a quantized base served from its checkpoint): as in TRL, the old
log-probabilities are then the trainer's, scored once per generation batch, and each token's loss is
weighed by the trainer-to-sampler ratio (`sampling_correction`), before the KL term.
"""

from __future__ import annotations

import contextlib
import math

import torch

from lora_tune.models.head import IGNORE, SOFTCAP_KEYS, auto_chunk_size, shifted_hidden, token_log_probs

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
IMPORTANCE_SAMPLING = ("token", "sequence")


def sampling_correction(old, sampling, owners, n: int, mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's `vllm_importance_sampling_correction` (GRPOTrainer._generate_and_score_completions), per
    label token: the ratio of the trainer's probability of each sampled token (`old`, no gradient) to
    the sampler's (`sampling`, vLLM's; NaN where it gave none: ratio 1), per token, or per sequence
    (the product over its tokens, `owners` naming each token's sequence among `n`); *_truncate
    clamps it to [clip_min, clip_max], *_mask sets it to 0 outside. Multiplies the per-token loss."""
    diff = torch.nan_to_num(old - sampling, nan=0.0)
    if mode.startswith("sequence"):
        ratio = torch.exp(diff.new_zeros(n).index_add(0, owners, diff))
    else:
        ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio.index_select(0, owners) if mode.startswith("sequence") else ratio


class GRPOLoss(torch.nn.Module):
    def __init__(self, peft_model, chunk_size: int | None, cfg):
        super().__init__()
        self.loss_type, self.importance_sampling = cfg.loss_type, cfg.importance_sampling
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r}")
        if self.importance_sampling not in IMPORTANCE_SAMPLING:
            raise ValueError(f"importance_sampling {self.importance_sampling!r}")
        self.peft_model = peft_model
        self.chunk_size = chunk_size  # None: per micro-batch (auto); 0: the model's full logits
        self.epsilon_low = cfg.epsilon
        self.epsilon_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        self.beta, self.temperature, self.max_new_tokens = cfg.beta, cfg.temperature, cfg.max_new_tokens
        config = peft_model.get_base_model().config.get_text_config(decoder=True)
        self.softcap = next((getattr(config, k) for k in SOFTCAP_KEYS if getattr(config, k, None)), None)
        self.stats: dict[str, list[float]] = {}
        self.recorded: list[torch.Tensor] | None = None  # set: forward only records per-token log-probabilities (a scoring pass)
        self.record_reference = False  # ... of the model with its adapter disabled (the reference)

    def get_base_model(self):
        return self.peft_model.get_base_model()

    # --- log-probabilities -------------------------------------------------------------------------
    def token_logps(self, input_ids, labels, attention_mask=None, position_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """([L], [L]): log p(token) of every label token under the policy at `temperature` (the
        distribution the completions were sampled from), in the order of the flattened shifted
        labels, and the entropy there (no gradient)."""
        targets = labels[:, 1:].reshape(-1)
        if self.chunk_size == 0:  # the model's own head and logit transforms, full [tokens x vocab] logits
            logits = self.peft_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
            keep = targets != IGNORE
            scaled = logits[:, :-1].reshape(-1, logits.shape[-1])[keep].float() / self.temperature
            every = torch.log_softmax(scaled, dim=-1)
            entropy = -(every.detach().exp() * every.detach()).sum(-1)
            return every.gather(1, targets[keep].unsqueeze(1)).squeeze(1), entropy
        hidden, _ = shifted_hidden(self.peft_model, input_ids, labels, attention_mask, position_ids)
        head = self.peft_model.get_base_model().get_output_embeddings()
        chunk = self.chunk_size or auto_chunk_size(hidden.shape[0], hidden.shape[1], head.weight.shape[0])
        return token_log_probs(hidden, head.weight, targets, chunk, self.softcap, head.bias, self.temperature)

    # --- the loss ----------------------------------------------------------------------------------
    def generate(self, **kwargs):
        """The policy's (base + adapter) completions, by transformers' `generate`: a method of the
        module the backends wrap, so a sharding backend's hooks can run around it."""
        return self.peft_model.generate(**kwargs)

    def forward(
        self,
        input_ids,
        labels,
        sequence_ids,
        advantages,
        num_items_in_batch,
        tokens_in_step=None,
        old_logps=None,
        ref_logps=None,
        importance_weights=None,
        attention_mask=None,
        position_ids=None,
    ):
        inputs = dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids)
        if self.recorded is not None:  # a scoring pass: the old policy, or the reference without the adapter
            adapter_off = self.peft_model.disable_adapter() if self.record_reference else contextlib.nullcontext()
            with torch.no_grad(), adapter_off:
                logps, _ = self.token_logps(**inputs)
            self.recorded.append(logps.detach().float().cpu())
            return logps.sum() * 0.0
        if self.beta != 0.0 and ref_logps is None:
            raise ValueError("GRPO with beta != 0 needs the reference log-probabilities (ref_logps)")
        logps, entropy = self.token_logps(**inputs)
        targets = labels[:, 1:].reshape(-1)
        owners = sequence_ids[:, 1:].reshape(-1)[targets != IGNORE]  # the completion each label token belongs to
        n = advantages.numel()
        lengths = torch.bincount(owners, minlength=n).to(logps.dtype).clamp(min=1.0)
        advantages = advantages.to(logps.device, logps.dtype)
        per_token_advantage = advantages.index_select(0, owners)
        old = logps.detach() if old_logps is None else old_logps.to(logps.device, logps.dtype)
        log_ratio = logps - old
        if self.importance_sampling == "token":
            coef_1 = torch.exp(log_ratio)
        else:  # GSPO: the sequence's length-averaged log-ratio, one weight for all its tokens
            sequence_coef = torch.exp(log_ratio.new_zeros(n).index_add(0, owners, log_ratio) / lengths)
            coef_1 = sequence_coef.index_select(0, owners)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss = -torch.min(coef_1 * per_token_advantage, coef_2 * per_token_advantage)
        if importance_weights is not None:  # vLLM sampled: TRL's correction, before the KL term
            per_token_loss = per_token_loss * importance_weights.to(logps.device, logps.dtype)
        if self.beta != 0.0:
            to_reference = ref_logps.to(logps.device, logps.dtype) - logps
            per_token_kl = torch.exp(to_reference) - to_reference - 1
            per_token_loss = per_token_loss + self.beta * per_token_kl
            self.note("kl", per_token_kl)
        self.note("entropy", entropy)
        if self.importance_sampling == "token":
            self._note_clipping(coef_1, per_token_advantage)
        else:  # TRL counts these per sequence
            self._note_clipping(sequence_coef, advantages)
        return self._reduce(per_token_loss, owners, lengths, n, num_items_in_batch, tokens_in_step)

    def _reduce(self, per_token_loss, owners, lengths, n: int, num_items_in_batch, tokens_in_step) -> torch.Tensor:
        """This micro-batch's share of the step's loss: TRL's reduction of `loss_type`, with its
        division by the accumulation steps made a division by the step's sequences (or tokens)."""
        if self.loss_type == "grpo":  # each sequence's mean over its tokens, averaged over sequences
            return (per_token_loss.new_zeros(n).index_add(0, owners, per_token_loss) / lengths).sum() / num_items_in_batch
        if self.loss_type == "bnpo":  # the micro-batch's mean over its tokens
            return per_token_loss.sum() / max(per_token_loss.numel(), 1) * n / num_items_in_batch
        if self.loss_type == "dr_grpo":  # as if every sequence had max_new_tokens tokens
            return per_token_loss.sum() / self.max_new_tokens / num_items_in_batch
        if tokens_in_step is None:
            raise ValueError("dapo divides by the step's completion tokens (tokens_in_step)")
        return per_token_loss.sum() / torch.as_tensor(tokens_in_step, dtype=per_token_loss.dtype).clamp(min=1.0)

    # --- metrics -----------------------------------------------------------------------------------
    def note(self, name: str, values: torch.Tensor, count: int | None = None) -> None:
        values = values.detach().float()
        entry = self.stats.setdefault(name, [0.0, 0])
        entry[0] += float(values.sum())
        entry[1] += values.numel() if count is None else count

    def _note_clipping(self, coef_1, advantages) -> None:
        """TRL's clip ratios: the share of tokens (sequences, for GSPO) whose ratio left the region on
        the side where clipping stops the update."""
        low = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
        high = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
        self.note("clip_ratio/low_mean", low)
        self.note("clip_ratio/high_mean", high)
        self.note("clip_ratio/region_mean", low | high)

    def take_stats(self) -> dict[str, tuple[float, int]]:
        """(sum, count) of each metric since it was last asked (the loop sums them over ranks)."""
        stats, self.stats = self.stats, {}
        return {name: (total, count) for name, (total, count) in stats.items()}
