"""The output head over the decoder's hidden states, chunk by chunk, never the whole logits: the
cross-entropy (SFT), per-sequence log-probabilities (preference) and per-token log-probabilities
with their entropies (online RL) every objective builds on.

With Llama-3's 128k vocabulary the `[tokens x vocab]` logits are the largest activation of a LoRA
run, and the usual route keeps them three times (compute dtype, the fp32 upcast, its gradient).
`linear_cross_entropy` runs the head over `chunk_size` label tokens at a time and, in the same pass,
computes the gradient with respect to the hidden states (softmax minus one-hot, through the head),
the way Liger's fused linear cross-entropy does: backward then only scales what forward kept (the
hidden-size gradient, small). The head is frozen (LoRA never adapts it), so no weight gradient is
needed, and nothing is recomputed. Positions whose label is masked (prompt tokens, padding) never go
through the head at all.

The objectives' loss modules (`lora_tune.training.objectives`) are what every engine trains: the
peft model, and a forward that returns the loss through these functions. They are the root that
FSDP2 and DeepSpeed wrap, so the head's weight is gathered while the loss runs.
"""

from __future__ import annotations

import math

import torch

from lora_tune.models.structure import decoder_body, multimodal_body

IGNORE = -100  # the label of a position with no loss (prompt, padding): PyTorch's and transformers' convention


def cross_entropy_chunk(h, t, weight, bias, softcap: float | None, keep_grad: bool):
    """One chunk of label positions: (summed cross-entropy, its gradient with respect to `h` or None).

    The softmax is computed in place in the chunk's logits buffer (the one [chunk x vocab] tensor it
    allocates): on a CPU, where these passes are memory-bound, that is 16% faster than logsumexp plus
    a separate softmax, and the same numbers. `--compile` compiles this function."""
    logits = (h @ weight.t() if bias is None else h @ weight.t() + bias).float()
    capped = None
    if softcap:  # Gemma-2 style: cap * tanh(logits / cap)
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    target = logits.gather(1, t.unsqueeze(1)).squeeze(1)
    peak = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(peak).exp_()  # softmax numerators, shifted by the row maximum for range
    norm = probs.sum(dim=1, keepdim=True)
    total = (norm.log() + peak).squeeze(1).sub_(target).sum()  # log-sum-exp minus the target's logit
    if not keep_grad:
        return total, None
    grad = probs.div_(norm)  # softmax
    grad.scatter_add_(1, t.unsqueeze(1), grad.new_full((t.numel(), 1), -1.0))
    if capped is not None:
        grad *= 1.0 - capped * capped
    return total, (grad.to(weight.dtype) @ weight).to(h.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor: float, chunk_size: int, softcap: float | None, chunk_fn):
        keep_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.zeros_like(hidden) if keep_grad else None
        total = hidden.new_zeros((), dtype=torch.float32)
        positions = (targets != IGNORE).nonzero().squeeze(1)  # masked positions never reach the head
        for start in range(0, positions.numel(), chunk_size):
            idx = positions[start : start + chunk_size]
            loss, grad = chunk_fn(hidden.index_select(0, idx), targets.index_select(0, idx), weight, bias, softcap, keep_grad)
            total += loss
            if keep_grad:
                grad_hidden.index_copy_(0, idx, grad)
        if keep_grad:
            ctx.save_for_backward(grad_hidden)
            ctx.divisor = divisor
        return total / divisor

    @staticmethod
    def backward(ctx, grad_output):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * (grad_output / ctx.divisor).to(grad_hidden.dtype), None, None, None, None, None, None, None


def log_prob_chunk(h, t, weight, bias, softcap: float | None, temperature: float, keep_grad: bool, entropy: bool):
    """One chunk of label positions: (log p(target) [chunk] in fp32, d logp / d `h` or None, the
    entropy of the distribution [chunk] or None), the logits capped (Gemma-2 style) and then divided
    by `temperature`, as the model's logits are when RL scores its own samples."""
    logits = (h @ weight.t() if bias is None else h @ weight.t() + bias).float()
    capped = None
    if softcap:
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    if temperature != 1.0:
        logits = logits.div_(temperature)
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.sub_(lse.unsqueeze(1))  # in place: the chunk's log-softmax
    chosen = logps.gather(1, t.unsqueeze(1)).squeeze(1)
    if not (keep_grad or entropy):
        return chosen, None, None
    probs = logps.exp()
    # -sum p log p as a batched dot product: no third [chunk x vocab] buffer.
    spread = -(probs.unsqueeze(1) @ logps.unsqueeze(2)).view(-1) if entropy else None
    if not keep_grad:
        return chosen, None, spread
    grad = probs.neg_()  # d logp / d logits = onehot - softmax
    grad.scatter_add_(1, t.unsqueeze(1), grad.new_ones((t.numel(), 1)))
    if capped is not None:
        grad *= 1.0 - capped * capped
    if temperature != 1.0:
        grad /= temperature
    return chosen, (grad.to(weight.dtype) @ weight).to(h.dtype), spread


def _label_log_probs(hidden, weight, bias, targets, chunk_size: int, softcap, temperature: float, keep_grad: bool, entropy: bool):
    """Over the label positions in order, `chunk_size` at a time: (positions, log p(target) [L],
    d logp / d hidden [L, hidden] or None, entropy [L] or None)."""
    positions = (targets != IGNORE).nonzero().squeeze(1)  # masked positions never reach the head
    n = positions.numel()
    logps = hidden.new_empty((n,), dtype=torch.float32)
    spread = hidden.new_empty((n,), dtype=torch.float32) if entropy else None
    grads = hidden.new_empty((n, hidden.shape[1])) if keep_grad else None
    for start in range(0, n, chunk_size):
        idx = positions[start : start + chunk_size]
        end = start + idx.numel()
        chosen, grad, ent = log_prob_chunk(
            hidden.index_select(0, idx), targets.index_select(0, idx), weight, bias, softcap, temperature, keep_grad, entropy
        )
        logps[start:end] = chosen
        if keep_grad:
            grads[start:end] = grad
        if entropy:
            spread[start:end] = ent
    return positions, logps, grads, spread


class _SequenceLogProbs(torch.autograd.Function):
    """Per sequence, the summed log-probability of its label tokens, chunk by chunk: the preference
    objectives' input. The loss is a nonlinear function of these sums, so forward keeps d logp / d
    hidden of each label position (hidden-size rows, as the cross-entropy above keeps its gradient)
    and backward scales each row by its sequence's upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, sequence_ids, n_sequences: int, chunk_size: int, softcap: float | None):
        keep_grad = ctx.needs_input_grad[0]
        positions, logps, grads, _ = _label_log_probs(hidden, weight, bias, targets, chunk_size, softcap, 1.0, keep_grad, False)
        owners = sequence_ids.index_select(0, positions)
        sums = logps.new_zeros((n_sequences,)).index_add_(0, owners, logps)
        if keep_grad:
            ctx.save_for_backward(grads, positions, owners)
            ctx.hidden_shape = hidden.shape
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        grads, positions, owners = ctx.saved_tensors
        grad_hidden = grads.new_zeros(ctx.hidden_shape)
        grad_hidden.index_copy_(0, positions, grads * grad_sums.index_select(0, owners).unsqueeze(1).to(grads.dtype))
        return grad_hidden, None, None, None, None, None, None, None


class _TokenLogProbs(torch.autograd.Function):
    """Per label position, its log-probability and (no gradient) the entropy there: online RL's input,
    whose loss is a nonlinear function of each token's log-probability. Forward keeps d logp / d
    hidden of each label position, backward scales each row by its own upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, softcap: float | None, temperature: float):
        keep_grad = ctx.needs_input_grad[0]
        positions, logps, grads, spread = _label_log_probs(hidden, weight, bias, targets, chunk_size, softcap, temperature, keep_grad, True)
        ctx.mark_non_differentiable(spread)
        if keep_grad:
            ctx.save_for_backward(grads, positions)
            ctx.hidden_shape = hidden.shape
        return logps, spread

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        grads, positions = ctx.saved_tensors
        grad_hidden = grads.new_zeros(ctx.hidden_shape)
        grad_hidden.index_copy_(0, positions, grads * grad_logps.unsqueeze(1).to(grads.dtype))
        return grad_hidden, None, None, None, None, None, None


def sequence_log_probs(hidden, weight, targets, sequence_ids, n_sequences: int, chunk_size: int, softcap=None, bias=None) -> torch.Tensor:
    """[n_sequences] summed log p(target) of each sequence's label positions (`sequence_ids` says
    whose each position is), computed `chunk_size` positions at a time; differentiable."""
    return _SequenceLogProbs.apply(hidden, weight, bias, targets, sequence_ids, n_sequences, chunk_size, softcap)


def token_log_probs(
    hidden, weight, targets, chunk_size: int, softcap=None, bias=None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """([L] log softmax(logits / temperature)[target], [L] entropy of that softmax) of each label
    position (targets != IGNORE) in position order, fp32, `chunk_size` positions at a time; the
    log-probabilities are differentiable with respect to `hidden`, the entropy carries no gradient."""
    return _TokenLogProbs.apply(hidden, weight, bias, targets, chunk_size, softcap, float(temperature))


# Fewest label tokens per automatic chunk. Below this the head's matmul has too few rows to run at
# full speed: on the CPU benchmark shape (hidden 512, vocab 32000, 4 x 1024 tokens) Liger's rule gives
# 64, and the loss's forward + backward takes 382 ms per step at 64 against 325 ms at 128 and 329 ms
# at 256; a 128-token chunk of a 128k vocabulary is about 63 MiB of fp32 logits.
MIN_AUTO_CHUNK = 128


# Most label tokens per automatic chunk. Liger's rule grows the chunk with the micro-batch; at long
# rows that is memory for nothing: Llama-3-8B (128k vocabulary) on one 262k-token row would take
# 8,192-token chunks, 10 GiB of logits and their fp32 gradient at once, where 2,048 (2.5 GiB) run its
# head's matmul at full speed (2,048 x 4,096 x 128k).
MAX_AUTO_CHUNK = 2048


def auto_chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's rule: about tokens / (vocab / hidden) tokens per chunk, a power of two, so a chunk's
    logits take about as much memory as the micro-batch's hidden states; at least MIN_AUTO_CHUNK, at
    most MAX_AUTO_CHUNK."""
    rule = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(vocab / hidden))))))
    return min(MAX_AUTO_CHUNK, max(MIN_AUTO_CHUNK, rule))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    divisor: float,
    chunk_size: int,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    chunk_fn=cross_entropy_chunk,
) -> torch.Tensor:
    """sum over label tokens of -log softmax(hidden @ weight.T + bias)[target] / divisor, computed
    `chunk_size` tokens at a time. `hidden` is [tokens, hidden], `targets` [tokens] with IGNORE for
    no label. `chunk_fn`: `cross_entropy_chunk`, or a compiled version of it."""
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, float(divisor), chunk_size, softcap, chunk_fn)


# Config attributes of logit transforms the chunked loss reproduces, and of those it does not.
SOFTCAP_KEYS = ("final_logit_softcapping",)
UNSUPPORTED_LOGIT_KEYS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def chunking_refusal(config) -> str | None:
    """Why this model's logits can't go through `linear_cross_entropy`, or None."""
    config = config.get_text_config(decoder=True)
    for key in UNSUPPORTED_LOGIT_KEYS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"its config scales the logits ({key})"
    return None


def shifted_hidden(
    peft_model, input_ids, labels, attention_mask=None, position_ids=None, vision: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """([positions, hidden], [positions]): the decoder's last hidden states and the token each one
    predicts (position t predicts token t + 1, shifted within each row), rows flattened.

    `vision` (image-text data: pixel inputs and token types, `lora_tune.data.batching.with_images`):
    the image-text model's body runs, its vision tower's features in place of the image tokens."""
    base = peft_model.get_base_model()
    # The decoder without its head (in an image-text wrapper: the language model's), or with images
    # the body that runs the tower first.
    body = multimodal_body(base) if vision else decoder_body(base)
    # No KV cache: with one, transformers stops reading packed sequences from position_ids.
    hidden = body(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **(vision or {})
    ).last_hidden_state
    return hidden[:, :-1].reshape(-1, hidden.shape[-1]), labels[:, 1:].reshape(-1)
