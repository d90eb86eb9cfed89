"""Preference objectives on LoRA: DPO, IPO, ORPO, SimPO and KTO as one loss module.

Every engine trains it the way it trains the SFT loss (`lora_tune.training.objectives.sft.CausalLMLoss`): the peft
model, and a forward that returns the step's share of the loss. A micro-batch holds units of two
sequences (a pair's chosen and rejected answer; a KTO row's completion and its KL sequence, its
prompt with another row's completion), packed into rows like SFT samples or one per row; the head
and log-softmax run chunk by chunk over the label positions only (`sequence_log_probs`), so the
[tokens x vocab] logits never exist, for either sequence.

The reference policy is the model at the start of training (the base, or the base with
--init-adapter): its log-probabilities are precomputed and arrive with the batch, or are computed
here in a no-grad forward with the adapter disabled. The formulas are TRL's (DPOTrainer's sigmoid
and length-normalised ipo losses, CPOTrainer's simpo, ORPOTrainer's odds ratio, KTOTrainer's kto),
so a first step equals TRL's on the same pairs (tests/test_preference.py); the metrics carry TRL's
names. Losses are summed over units and divided by the units of the whole step (all ranks, all
micro-batches), so accumulation and several ranks equal one big batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lora_tune.models.head import IGNORE, SOFTCAP_KEYS, auto_chunk_size, sequence_log_probs, shifted_hidden

OBJECTIVES = ("dpo", "ipo", "orpo", "simpo", "kto")
WITH_REFERENCE = ("dpo", "ipo", "kto")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (ORPO's odds)."""
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class PreferenceLoss(torch.nn.Module):
    def __init__(self, peft_model, chunk_size: int | None, objective: str, cfg):
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(objective)
        self.peft_model = peft_model
        self.chunk_size = chunk_size  # None: per micro-batch (auto); 0: the model's full logits
        self.objective = objective
        self.beta, self.gamma, self.orpo_lambda = cfg.beta, cfg.simpo_gamma, cfg.orpo_lambda
        self.desirable_weight, self.undesirable_weight = cfg.kto_desirable_weight, cfg.kto_undesirable_weight
        config = peft_model.get_base_model().config.get_text_config(decoder=True)
        self.softcap = next((getattr(config, k) for k in SOFTCAP_KEYS if getattr(config, k, None)), None)
        self.stats: dict[str, list[float]] = {}
        self.recorded: list[torch.Tensor] | None = None  # set: forward only records log-probabilities (the reference pass)
        # The model at the start is the base (a fresh adapter computes nothing yet): scored with the
        # adapter disabled, which stays true on a resume; an --init-adapter is scored as loaded.
        self.reference_is_base = not cfg.init_adapter

    def get_base_model(self):
        return self.peft_model.get_base_model()

    # --- log-probabilities -------------------------------------------------------------------------
    def sequence_logps(
        self, input_ids, labels, sequence_ids, n_sequences: int, attention_mask=None, position_ids=None, context: bool = False
    ) -> torch.Tensor:
        """[n_sequences] summed log-probabilities of each sequence's label tokens. `context`: also
        the sequences' unlabelled tokens (the prompt), as [2, n_sequences] (labelled, unlabelled)."""
        targets, owners, n = labels[:, 1:].reshape(-1), sequence_ids[:, 1:].reshape(-1), n_sequences
        if context:  # every token of a sequence but its first; the prompt's scored under owner + n
            inside = (sequence_ids[:, 1:] == sequence_ids[:, :-1]).reshape(-1) & (owners >= 0)
            prompt = inside & (targets == IGNORE)
            targets = torch.where(prompt, input_ids[:, 1:].reshape(-1), targets)
            owners, n = torch.where(prompt, owners + n_sequences, owners), 2 * n_sequences
        if self.chunk_size == 0:  # the model's own head and logit transforms, full [tokens x vocab] logits
            logits = self.peft_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
            flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
            per_token = -F.cross_entropy(flat, targets, ignore_index=IGNORE, reduction="none")
            sums = per_token.new_zeros(n).index_add(0, owners.clamp(min=0), per_token)  # unlabelled positions add 0
        else:
            hidden, _ = shifted_hidden(self.peft_model, input_ids, labels, attention_mask, position_ids)
            head = self.peft_model.get_base_model().get_output_embeddings()
            chunk = self.chunk_size or auto_chunk_size(hidden.shape[0], hidden.shape[1], head.weight.shape[0])
            sums = sequence_log_probs(hidden, head.weight, targets, owners, n, chunk, self.softcap, head.bias)
        return sums.view(2, n_sequences) if context else sums

    def reference_logps(self, **inputs) -> torch.Tensor:
        """The model without its adapter (the base: the reference of a fresh adapter), no gradient."""
        with torch.no_grad(), self.peft_model.disable_adapter():
            return self.sequence_logps(**inputs)

    # --- the loss ----------------------------------------------------------------------------------
    def generate(self, **kwargs):
        """The policy's (base + adapter) completions, by transformers' `generate`: a method of the
        module the backends wrap, so a sharding backend's hooks can run around it."""
        return self.peft_model.generate(**kwargs)

    def forward(
        self,
        input_ids,
        labels,
        num_items_in_batch,
        sequence_ids,
        sequence_label_tokens,
        unit_labels,
        chosen_tokens_in_step=None,
        reference_logps=None,
        attention_mask=None,
        position_ids=None,
    ):
        inputs = dict(
            input_ids=input_ids,
            labels=labels,
            sequence_ids=sequence_ids,
            n_sequences=sequence_label_tokens.numel(),
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        if self.recorded is not None:  # the reference pass: the starting model, scored
            scored = self.reference_logps(**inputs) if self.reference_is_base else self.sequence_logps(**inputs)
            self.recorded.append(scored.detach().float().cpu())
            return scored.sum() * 0.0
        if self.objective in WITH_REFERENCE and reference_logps is None:
            # First, while no activations are saved for backward: its peak stays below training's.
            reference_logps = self.reference_logps(**inputs)
        if self.objective == "orpo":  # its NLL term covers the prompt too
            policy, prompt = self.sequence_logps(**inputs, context=True)
        else:
            policy = self.sequence_logps(**inputs)
        lengths = sequence_label_tokens.to(policy.dtype).clamp(min=1)
        first, second = policy[0::2], policy[1::2]  # chosen, rejected (KTO: the row, its KL sequence)
        if self.objective == "kto":
            losses = self._kto(first, second, reference_logps[0::2], reference_logps[1::2], unit_labels)
        elif self.objective == "orpo":
            predicted = torch.bincount(sequence_ids[sequence_ids >= 0], minlength=lengths.numel())[0::2] - 1
            losses = self._orpo(first, second, prompt[0::2], lengths, predicted.sum(), num_items_in_batch, chosen_tokens_in_step)
        else:
            losses = self._pairs(first, second, reference_logps, lengths)
        return losses.sum() / num_items_in_batch

    def _pairs(self, chosen, rejected, reference, lengths) -> torch.Tensor:
        """dpo, ipo, simpo: one loss per pair."""
        if self.objective == "simpo":  # TRL CPOTrainer, loss_type="simpo": average log-probs, no reference
            chosen_score, rejected_score = chosen / lengths[0::2], rejected / lengths[1::2]
            losses = -F.logsigmoid(self.beta * (chosen_score - rejected_score - self.gamma / self.beta))
            self._note_pairs(self.beta * chosen_score, self.beta * rejected_score, chosen, rejected, lengths)
            return losses
        chosen_ratio, rejected_ratio = chosen - reference[0::2], rejected - reference[1::2]
        if self.objective == "dpo":
            losses = -F.logsigmoid(self.beta * (chosen_ratio - rejected_ratio))
        else:  # ipo, length-normalised as TRL's DPOTrainer does it
            delta = chosen_ratio / lengths[0::2] - rejected_ratio / lengths[1::2]
            losses = (delta - 1 / (2 * self.beta)) ** 2
        self._note_pairs(self.beta * chosen_ratio, self.beta * rejected_ratio, chosen, rejected, lengths)
        return losses

    def _orpo(self, chosen, rejected, chosen_prompt, lengths, chosen_tokens, units_in_step, chosen_tokens_in_step) -> torch.Tensor:
        """TRL ORPOTrainer (and the ORPO authors' code): the NLL of the chosen sequences, prompt
        included, per token over the step's chosen-sequence tokens, minus lambda x log-sigmoid of the
        log odds ratio of the completions' length-averaged log-probabilities."""
        chosen_avg, rejected_avg = chosen / lengths[0::2], rejected / lengths[1::2]
        log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
        ratio = F.logsigmoid(log_odds)
        chosen_all = chosen + chosen_prompt
        # Per unit: its share of the NLL term (scaled from per-token to per-unit normalisation) and of the ratio term.
        losses = -chosen_all * (units_in_step / chosen_tokens_in_step) - self.orpo_lambda * ratio
        self._note_pairs(self.orpo_lambda * chosen_avg, self.orpo_lambda * rejected_avg, chosen, rejected, lengths)
        self._note("log_odds_ratio", ratio)
        self._note("log_odds_chosen", log_odds)
        self._note("nll_loss", -chosen_all.sum(), count=int(chosen_tokens))
        return losses

    def _kto(self, policy, policy_kl, reference, reference_kl, desirable) -> torch.Tensor:
        """TRL KTOTrainer: log ratios against a reference point (the KL estimate of this micro-batch's
        mismatched pairs, non-negative, no gradient); desirable rows pulled above it, others below."""
        kl = (policy_kl - reference_kl).mean().detach().clamp(min=0)
        ratio = policy - reference
        wanted = desirable == 1
        losses = torch.where(
            wanted,
            self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl))),
            self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratio))),
        )
        rewards = (self.beta * ratio).detach()
        self._note("rewards/chosen", rewards[wanted])
        self._note("rewards/rejected", rewards[~wanted])
        self._note("kl", kl.reshape(1))
        return losses

    # --- metrics -----------------------------------------------------------------------------------
    def _note(self, name: str, values: torch.Tensor, count: int | None = None) -> None:
        values = values.detach().float()
        entry = self.stats.setdefault(name, [0.0, 0])
        entry[0] += float(values.sum())
        entry[1] += values.numel() if count is None else count

    def _note_pairs(self, chosen_rewards, rejected_rewards, chosen, rejected, lengths) -> None:
        self._note("rewards/chosen", chosen_rewards)
        self._note("rewards/rejected", rejected_rewards)
        self._note("rewards/margins", chosen_rewards - rejected_rewards)
        self._note("rewards/accuracies", (chosen_rewards > rejected_rewards).float())
        self._note("logps/chosen", chosen)
        self._note("logps/rejected", rejected)

    def take_stats(self) -> dict[str, tuple[float, int]]:
        """(sum, count) of each metric since it was last asked (the loop sums them over ranks)."""
        stats, self.stats = self.stats, {}
        return {name: (total, count) for name, (total, count) in stats.items()}
