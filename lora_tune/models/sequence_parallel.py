"""Sequence parallelism, Ulysses style (DeepSpeed's ALST): the N ranks of a group share every row of
a micro-batch, each holding 1/N of its tokens (consecutive). Everything but attention works token by
token, so each rank runs it on its own tokens; around attention an all-to-all turns "my tokens, all
heads" into "all tokens, my heads", each rank attends over the whole row for its 1/N of the heads,
and a second all-to-all turns the result back. Activations per rank are 1/N of the row's.

The all-to-all is `torch.distributed.all_to_all_single` with its backward (the inverse exchange of
the gradients), so it runs on NCCL and gloo alike. With grouped-query attention whose
key/value heads don't divide by N, each key/value head is repeated for its query heads first (ALST
does the same): every rank then holds the key/value heads its query heads read.

The row is prepared before it is split (`lora_tune.data.batching.shard_rows`): position ids come
from the whole row, labels are shifted on the whole row, and the sample boundaries of a packed row
(`row_position_ids`, restarting at 0 per sample) travel whole to attention, which never derives them
from a shard. The attention implementation is registered with transformers as `ulysses_<inner>`:
the model builds no mask for it (its mask function returns None: a shard's positions can't say
which keys a query sees), and the attention computes what `<inner>` would over the whole row with
the block-diagonal causal structure of its samples. Generation (evaluation prompts) runs on one rank
with the whole sequence: `plain_attention` switches the model back to `<inner>` around it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface

from lora_tune.models.attention import per_sample_sdpa
from lora_tune.models.structure import decoder_body

PREFIX = "ulysses_"
# Attention over the whole row, per inner implementation; every one gets [rows, heads, tokens, dim].
INNER = ("sdpa", "sdpa_packed", "eager", "flash_attention_2")
# Config attributes that make attention scores differ from plain causal attention over a sample:
# the attention here would not reproduce them, so such families are refused (`refusal`).
SHAPING_CONFIG = ("attn_logit_softcapping", "attention_chunk_size", "sliding_window_pattern")


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: the process group, its size and this rank's place in
    it (which 1/size of every row it holds)."""

    group: object  # a torch.distributed ProcessGroup
    size: int
    index: int
    buffers: dict = field(default_factory=dict, compare=False)  # the all-to-all's send and receive buffers, per shape


@dataclass(frozen=True)
class RowShards:
    """What attention needs beyond a shard's tensors, passed down the decoder as a keyword."""

    group: SequenceGroup
    sample_ids: torch.Tensor  # [rows, whole row's tokens]: which sample each position belongs to


def refusal(config, size: int) -> str | None:
    """Why this model can't be trained with `--sequence-parallel size`, or None."""
    text = config.get_text_config(decoder=True)
    if text is not config:
        return f"{config.model_type} is an image-text model; sequence parallelism trains text-only models for now"
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return f"{config.model_type}'s config does not say its attention heads"
    if heads % size:
        return f"{config.model_type} has {heads} attention heads, which {size} ranks can't split evenly; use a divisor of {heads}"
    shaping = [k for k in SHAPING_CONFIG if getattr(text, k, None)]
    windows = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if shaping or windows or kinds != {"full_attention"}:
        what = ", ".join(shaping) or ("sliding-window layers" if windows or "sliding_attention" in kinds else ", ".join(sorted(kinds)))
        return f"{config.model_type} shapes its attention ({what}), which sequence-parallel attention does not reproduce yet"
    return None


def sample_ids(row_position_ids: torch.Tensor) -> torch.Tensor:
    """[rows, tokens] sample index of each position: a sample starts where its positions restart at 0."""
    return (row_position_ids == 0).cumsum(dim=1)


class _Exchange(torch.autograd.Function):
    """The all-to-all: `x` cut into group.size pieces along `split`, piece j sent to rank j; the
    pieces received (from ranks 0..size-1) joined along `join`. Its gradient travels back the
    inverse way (cut along `join`, joined along `split`).

    The pieces are copied into, and received in, two buffers kept by the group per size and reused
    by every exchange of the step (q, k, v and the attention output are the same size when the
    key/value heads are repeated): gloo lets go of an exchange's tensors from its own threads, so
    fresh buffers per exchange would pile up for a while (measured: the step's peak varied by a
    layer's exchanges from run to run); reused ones cost the same two buffers every time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: SequenceGroup, split: int, join: int) -> torch.Tensor:
        ctx.group, ctx.split, ctx.join = group, split, join
        return _all_to_all(x, group, split, join)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.join, ctx.split), None, None, None


def _all_to_all(x: torch.Tensor, group: SequenceGroup, split: int, join: int) -> torch.Tensor:
    pieces = x.chunk(group.size, dim=split)
    shape = (group.size, *pieces[0].shape)
    key = (x.numel(), x.dtype, x.device)  # by size: q's pieces and the output's differ in shape only
    if key not in group.buffers:
        group.buffers[key] = (x.new_empty(x.numel()), x.new_empty(x.numel()))
    send, received = (buffer.view(shape) for buffer in group.buffers[key])
    for j, piece in enumerate(pieces):
        send[j].copy_(piece)
    torch.distributed.all_to_all_single(received, send, group=group.group)
    return torch.cat(received.unbind(0), dim=join)


def _exchange(x: torch.Tensor, group: SequenceGroup, split: int, join: int) -> torch.Tensor:
    """Differentiable all-to-all (`_Exchange`)."""
    return _Exchange.apply(x, group, split, join)


def _eager(query, key, value, ids, dropout: float, scaling, training: bool) -> torch.Tensor:
    """transformers' eager attention (scores, fp32 softmax, dropout) with the row's block-diagonal causal mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    tokens = ids.shape[1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=ids.device).tril()
    allowed = (ids[:, None, :, None] == ids[:, None, None, :]) & causal
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(2, 3)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = F.dropout(scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype), p=dropout, training=training)
    return (weights @ value).transpose(1, 2)


def _flash(module, query, key, value, ids, dropout: float, scaling, kwargs) -> torch.Tensor:
    """flash-attention's variable-length kernel over the rows flattened, one sequence per sample."""
    from transformers.integrations.flash_attention import flash_attention_forward  # noqa: PLC0415 - GPU only

    rows, heads, tokens, dim = query.shape
    flat = (ids + torch.arange(rows, device=ids.device)[:, None] * (tokens + 1)).reshape(-1)  # samples of different rows differ
    lengths = torch.unique_consecutive(flat, return_counts=True)[1]
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max())

    def flatten(x):
        return x.transpose(0, 1).reshape(1, x.shape[1], rows * tokens, dim)

    seqlens = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    out, _ = flash_attention_forward(
        module, flatten(query), flatten(key), flatten(value), None, dropout=dropout, scaling=scaling, **seqlens, **kwargs
    )
    return out.reshape(rows, tokens, heads, dim)


def _attention(inner: str):
    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, row_shards: RowShards | None = None, **kwargs):
        if row_shards is None:
            raise RuntimeError(f"{PREFIX}{inner} attention runs on row shards only; generation switches to {inner} (plain_attention)")
        group = row_shards.group
        if key.shape[1] % group.size:  # fewer key/value heads than ranks: each query head's own copy
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        # [rows, heads, my tokens, dim] -> [rows, my heads, all tokens, dim]
        q, k, v = (_exchange(t, group, split=1, join=2) for t in (query, key, value))
        ids = row_shards.sample_ids
        if inner == "eager":
            out = _eager(q, k, v, ids, dropout, scaling, module.training)
        elif inner == "flash_attention_2":
            out = _flash(module, q, k, v, ids, dropout, scaling, {k: v for k, v in kwargs.items() if k != "position_ids"})
        else:  # sdpa and sdpa_packed: the same numbers; per sample, no mask over the whole row
            out = per_sample_sdpa(q, k, v, ids, dropout, scaling)
        # [rows, all tokens, my heads, dim] -> [rows, my tokens, all heads, dim], as attention returns
        return _exchange(out, group, split=1, join=2).contiguous(), None

    return forward


def _no_mask(*args, **kwargs) -> None:  # noqa: ARG001 - transformers' mask-function signature
    return None


for _inner in INNER:
    AttentionInterface.register(PREFIX + _inner, _attention(_inner))
    AttentionMaskInterface.register(PREFIX + _inner, _no_mask)


def implementation(inner: str, size: int) -> str:
    """The attention implementation a model loads with under `--sequence-parallel size`."""
    return PREFIX + inner if size > 1 else inner


@contextlib.contextmanager
def plain_attention(model):
    """The model's own attention (the inner implementation) for what runs outside row shards: generation."""
    current = model.config._attn_implementation
    if not current.startswith(PREFIX):
        yield
        return
    model.set_attn_implementation(current.removeprefix(PREFIX))
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def shard_hidden(peft_model, input_ids, position_ids, row_position_ids, group: SequenceGroup) -> torch.Tensor:
    """[shard's positions, hidden]: the decoder's last hidden states of this rank's tokens, rows flattened."""
    body = decoder_body(peft_model.get_base_model())
    shards = RowShards(group, sample_ids(row_position_ids))
    hidden = body(input_ids=input_ids, position_ids=position_ids, use_cache=False, row_shards=shards).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])
