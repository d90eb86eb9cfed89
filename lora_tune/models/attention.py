"""Attention over packed rows, sample by sample: `sdpa_packed`.

A packed row holds several samples; transformers reads them from `position_ids` and gives SDPA a
block-diagonal causal mask over the whole row, so a 1,024-token row of nine samples pays attention
over 1,024 x 1,024 positions, most of them masked, through SDPA's masked kernel. `sdpa_packed` runs
SDPA once per sample instead (its causal kernel, no mask): on a 2-core CPU 0.036 s instead of
0.125 s per layer's forward + backward for 4 rows of nine samples. The numbers are the same: each
position attends to the same keys.

It is registered with transformers' own extension points (`AttentionInterface` for the attention,
`AttentionMaskInterface` for the mask, which is SDPA's), so the model builds exactly the mask it
builds for `sdpa`, and the per-sample path is taken only when that mask is verified to be the
block-diagonal causal mask of the row's samples (found from `position_ids` as transformers finds
them) and nothing else shapes the scores: no sliding window, soft cap, attention sinks or position
bias, no KV cache, a causal module. Anything else (unpacked rows, generation, image tokens that
attend both ways, families with windows or sinks) runs transformers' `sdpa` unchanged. Only the
models that call attention through that interface (`is_backend_compatible()`) can use it.

`--attn-implementation auto` picks it on a CPU when packing is on and the layers are not compiled
(the per-sample loop and the mask check are Python control flow that would break the graph); on a
GPU auto stays with flash_attention_2 / sdpa, as the per-sample path is unmeasured there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import find_packed_sequence_indices, sdpa_mask

NAME = "sdpa_packed"
SHAPING_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks")  # what makes scores differ from plain causal attention
VERIFY_ROWS = 1024  # query positions whose mask rows are checked at a time


def sample_ids(module, query, key, attention_mask, position_bias, is_causal, kwargs) -> torch.Tensor | None:
    """[rows, tokens] sample index of each position when the per-sample path gives SDPA's numbers
    exactly, else None."""
    position_ids = kwargs.get("position_ids")
    rows, tokens = query.shape[0], query.shape[2]
    if (
        position_ids is None
        or position_bias is not None
        or is_causal is False
        or not getattr(module, "is_causal", True)
        or any(kwargs.get(k) is not None for k in SHAPING_KWARGS)
        or key.shape[2] != tokens
        or not isinstance(attention_mask, torch.Tensor)
        or attention_mask.dtype != torch.bool
        or attention_mask.shape[-2:] != (tokens, tokens)
        or attention_mask.dim() != 4
    ):
        return None
    ids = find_packed_sequence_indices(position_ids.expand(rows, -1))
    if ids is None:
        return None
    # Compared VERIFY_ROWS query positions at a time: the mask is tokens x tokens, and a whole
    # expected mask (with its intermediates) would take several times that at long rows.
    mask = attention_mask.expand(rows, -1, -1, -1)
    keys = torch.arange(tokens, device=query.device)
    for start in range(0, tokens, VERIFY_ROWS):
        queries = keys[start : start + VERIFY_ROWS]
        expected = (ids[:, None, queries, None] == ids[:, None, None, :]) & (keys[None, :] <= queries[:, None])
        if not torch.equal(mask[:, :, start : start + VERIFY_ROWS], expected.expand(-1, mask.shape[1], -1, -1)):
            return None
    return ids


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, position_bias=None, **kwargs):
    ids = sample_ids(module, query, key, attention_mask, position_bias, is_causal, kwargs)
    if ids is None:
        shaped = {"dropout": dropout, "scaling": scaling, "is_causal": is_causal, "position_bias": position_bias}
        return sdpa_attention_forward(module, query, key, value, attention_mask, **shaped, **kwargs)
    return per_sample_sdpa(query, key, value, ids, dropout, scaling).contiguous(), None  # [rows, tokens, heads, head_dim], as sdpa returns


def per_sample_sdpa(query, key, value, ids, dropout: float, scaling) -> torch.Tensor:
    """SDPA's causal kernel once per sample of each row, no mask: [rows, tokens, heads, head_dim]
    from [rows, heads, tokens, head_dim]; `ids` [rows, tokens] says which sample each position is."""
    gqa = query.shape[1] != key.shape[1]
    rows = []
    # unbind / split rather than slicing: their backward concatenates the gradients once, where each
    # slice's backward would write into a zeroed tensor of the whole row.
    for row_ids, q, k, v in zip(ids.unbind(0), query.unbind(0), key.unbind(0), value.unbind(0), strict=True):
        lengths = torch.unique_consecutive(row_ids, return_counts=True)[1].tolist()
        pieces = zip(q.split(lengths, dim=1), k.split(lengths, dim=1), v.split(lengths, dim=1), strict=True)
        outputs = [
            F.scaled_dot_product_attention(qs[None], ks[None], vs[None], dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
            for qs, ks, vs in pieces
        ]
        rows.append(torch.cat(outputs, dim=2))
    return torch.cat(rows).transpose(1, 2)


AttentionInterface.register(NAME, packed_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


# Longest rows before a quadratic attention cost is worth a line: eager keeps [heads x tokens x
# tokens] scores per layer; masked SDPA gets a [tokens x tokens] mask per row from transformers (1 GiB
# at 32k tokens, built from three such grids) and its flash kernel can't take a mask.
EAGER_WARN_TOKENS = 8192
MASK_WARN_TOKENS = 32768


def quadratic_attention_warning(attention: str, row_tokens: int, packing: bool) -> str | None:
    """The one line saying the chosen attention costs memory quadratic in the row at this length, or None."""
    if attention == "eager" and row_tokens >= EAGER_WARN_TOKENS:
        return (
            f"eager attention keeps every layer's [heads x {row_tokens:,} x {row_tokens:,}] scores: use sdpa or flash_attention_2 "
            "(and --sequence-parallel for rows longer than one device holds)"
        )
    if attention in ("sdpa", NAME) and packing and row_tokens >= MASK_WARN_TOKENS:
        gib = 3 * row_tokens**2 / 2**30
        return (
            f"{attention} over packed rows of {row_tokens:,} tokens gets a [tokens x tokens] mask from transformers ({gib:.0f} GiB "
            "while it is built, per row): use --attn-implementation flash_attention_2 on a GPU, or --sequence-parallel, whose "
            "attention needs no mask"
        )
    return None
