"""The smallest config of a family that keeps its structure: `shrink_config(config)`.

Turns any transformers config (a text config, or a composite image-text config with `text_config`,
`vision_config`, ... sub-configs) into one that builds a model of a few hundred thousand parameters
in a fraction of a second, while keeping what makes the family itself:

* the layer pattern: every distinct kind of layer (linear / full / sliding / chunked attention,
  Mamba / recurrent blocks, dense first layers, MoE every k layers, no-RoPE layers, per-layer
  overrides of `per_layer_config`) survives, in 2-4 layers. The kinds are read from the config's
  per-layer attributes (lists as long as the model, layer-index lists, `first_k_dense_replace`,
  `*_period`/`*_offset`, `decoder_sparse_step`, `moe_layer_freq`, ...); one representative of each
  kind is kept, in order, and every per-layer attribute is re-indexed to the kept layers.
* the attention geometry: 4 query heads, the key/value head ratio (MHA, GQA or MQA), head_dim 16;
  MLA ranks (`q_lora_rank`, `kv_lora_rank`, `qk_rope_head_dim`, `qk_nope_head_dim`, `v_head_dim`);
  linear-attention (gated delta net) and SSM head layouts, with their divisibility constraints.
* MoE: at most 4 routed experts, top-2, shared experts kept, routing groups kept (2 groups).
* a small vocabulary (`vocab_size`, default 512 = `lora_tune.models.tiny_model.train_tiny_tokenizer()`)
  with bos/eos/pad = 1/2/0 like that tokenizer; special multimodal token ids (image, video, audio,
  boi/eoi, ...) get ids just above it, which the text tokenizer never produces.
* vision / audio towers: narrower, 2-4 layers (their layer-index lists remapped), hidden 64.
  Attributes of one sub-config that equal another's dimension (a projector's `out_hidden_size` =
  the text hidden size, ...) follow that dimension.

Everything is decided from the config's own attributes: `attribute_map` gives the canonical name
of each attribute (`n_embd` is `hidden_size`, `moe_topk` is `num_experts_per_tok`, ...), sub-configs
come from `sub_configs`. A per-model-type override table (`OVERRIDES`) takes the few cases that
generic rules can't, each with the reason.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from transformers import PreTrainedConfig

# --- target sizes --------------------------------------------------------------------------------
TEXT_VOCAB = 512  # lora_tune.models.tiny_model.train_tiny_tokenizer(); multimodal special ids go above it
HIDDEN = 64
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
HEADS = 4
HEAD_DIM = 16
EXPERTS = 4
TOP_K = 2
MAX_POSITIONS = 512
WINDOW = 16  # sliding / chunked attention windows: below the sweep's 64-token rows, so windows bite
VISION_HIDDEN = 64
MAX_LAYERS = 4

# Canonical names (after attribute_map) of the attributes the generic rules set. Several names per
# role: families spell the same thing differently and not all declare an attribute_map.
LAYER_COUNT = ("num_hidden_layers", "num_layers", "n_layers", "n_layer", "depth", "num_blocks", "decoder_layers", "encoder_layers")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "embedding_dim", "dim", "width")
INTERMEDIATE_KEYS = (
    "intermediate_size",
    "ffn_dim",
    "ffn_hidden_size",
    "n_inner",
    "d_ff",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "mlp_dim",
    "intermediate_size_mlp",
    "dense_intermediate_size",
)
EXPERT_INTERMEDIATE_KEYS = (
    "moe_intermediate_size",
    "expert_ffn_hidden_size",
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "shared_experts_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "expert_intermediate_size",
)
HEAD_KEYS = (
    "num_attention_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "swa_num_attention_heads",
    "num_heads",
    "n_head",
    "n_heads",
    "attention_heads",
)
KV_HEAD_KEYS = ("num_key_value_heads", "swa_num_key_value_heads", "num_query_groups", "multi_query_group_num", "n_kv_heads")
HEAD_DIM_KEYS = ("head_dim", "swa_head_dim", "attention_head_dim", "kv_channels", "d_kv", "d_head")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token", "moe_top_k")
SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
GROUP_KEYS = ("n_group", "num_expert_group")
MLA = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
LINEAR_ATTENTION = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_head_dim": 16}
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "attention_window_size", "window_size", "local_window_size")
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "model_max_length",
    "context_length",
    "n_ctx",
    "max_target_positions",
)
# Token ids the tiny tokenizer has (train_tiny_tokenizer: <pad>=0, <s>=1, </s>=2).
TEXT_TOKEN_IDS = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "forced_bos_token_id": 1,
    "forced_eos_token_id": 2,
    "_pad_token_id": 0,
}
# Not sizes, whatever their names say: left alone.
KEEP = {
    "num_channels",
    "in_channels",
    "out_channels",
    "patch_size",
    "image_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "conv_kernel",
    "linear_conv_kernel_dim",
    "conv_L_cache",
    "mamba_d_conv",
    "conv1d_width",
    "num_labels",
    "type_vocab_size",
    "num_mel_bins",
    "sampling_rate",
    "initializer_range",
    "chunk_size_feed_forward",
    "max_window_layers",
    "tokens_per_second",
    "merge_size",
}

# Per model type: updates applied after the generic rules, only where those can't be right.
OVERRIDES: dict[str, dict[str, Any]] = {
    # The default config leaves layer_types None and the model indexes it ("conv" / "full_attention"
    # per layer); the real LFM2-MoE checkpoints list them. Two dense layers first, as the default says.
    "lfm2_moe": {"num_hidden_layers": 4, "num_dense_layers": 2, "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # The default LFM2 config makes every layer full attention (full_attn_idxs = all); the released checkpoints
    # interleave short-convolution ("conv") layers, the part that matters for packing.
    "lfm2": {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_vl": {
        "text_config.num_hidden_layers": 4,
        "text_config.full_attn_idxs": [1, 3],
        "text_config.layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
}


# --- helpers ---------------------------------------------------------------------------------------
def _canonical_names(config) -> dict[str, str]:
    """Stored attribute name -> canonical name, from the config's own attribute_map."""
    amap = dict(getattr(config, "attribute_map", {}) or {})
    return {stored: canonical for canonical, stored in amap.items() if isinstance(stored, str)}


def _kv_heads(orig_heads: int | None, orig_kv: int | None, heads: int = HEADS) -> int | None:
    """Keep the family's attention kind: MHA (kv = heads), MQA (kv = 1) or GQA (kv = heads / 2)."""
    if orig_kv is None or not isinstance(orig_kv, int):
        return orig_kv
    if orig_heads and orig_kv >= orig_heads:
        return heads
    if orig_kv == 1:
        return 1
    return max(1, heads // 2)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _scale_index(i: int, old: int, new: int) -> int:
    """Map a layer index of a `old`-layer stack onto a `new`-layer one (negative indices too)."""
    negative = i < 0
    j = i + old if negative else i
    j = min(new - 1, max(0, round(j * (new - 1) / max(1, old - 1))))
    return j - new if negative else j


# --- the layer pattern -----------------------------------------------------------------------------
INDEX_LIST_HINT = re.compile(r"(layers|idxs|indexes|indices|layer_ids|_ids)$")


def _is_index_list(k: str, v, n: int) -> bool:
    """A list of distinct layer indices (mlp_only_layers, full_attn_idxs, moe_layers, hybrid_layer_ids...)."""
    return (
        isinstance(v, (list, tuple))
        and bool(INDEX_LIST_HINT.search(k))
        and "token" not in k
        and all(_is_int(x) and 0 <= x < n for x in v)
        and len(set(v)) == len(v)
    )


def _is_pointer_list(k: str, v, n: int) -> bool:
    """One layer index per layer: the layer whose state this one reads (kv_source_layers)."""
    return (
        isinstance(v, (list, tuple)) and len(v) == n and "layer" in k and all(_is_int(x) and 0 <= x < n for x in v) and len(set(v)) < len(v)
    )


def _per_layer_lists(d: dict, n: int) -> list[str]:
    """Attributes holding one entry per layer (lists or strings as long as the model)."""
    out = []
    for k, v in d.items():
        if k in ("id2label", "label2id") or k.endswith("_config") or _is_index_list(k, v, n):
            continue
        if isinstance(v, (list, tuple)) and len(v) == n and n > 1:
            out.append(k)
        elif isinstance(v, str) and len(v) == n and n > 2 and k.endswith(("pattern", "_types")):
            out.append(k)  # e.g. nemotron's hybrid_override_pattern "M-M-M*-..."
    return out


def _index_lists(d: dict, n: int, per_layer: list[str]) -> list[str]:
    return [k for k, v in d.items() if k not in per_layer and _is_index_list(k, v, n)]


def _layer_signatures(d: dict, n: int, per_layer: list[str], index_lists: list[str]) -> list[tuple]:
    """One signature per layer: everything the config says differs between layers."""
    sigs: list[list] = [[] for _ in range(n)]
    for k in per_layer:
        pointer = _is_pointer_list(k, d[k], n)
        for i in range(n):
            sigs[i].append((k, d[k][i] == i if pointer else repr(d[k][i])))
    if _is_int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:
        for i in range(n):  # the last k layers reuse earlier layers' keys/values
            sigs[i].append(("num_kv_shared_layers", i >= n - d["num_kv_shared_layers"]))
    for k in index_lists:
        members = set(d[k])
        for i in range(n):
            sigs[i].append((k, i in members))
    for k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if _is_int(d.get(k)) and d[k] > 0:
            for i in range(n):
                sigs[i].append((k, i < d[k]))
    if _is_int(d.get("moe_layer_end_index")) and d["moe_layer_end_index"] >= 0:
        for i in range(n):
            sigs[i].append(("moe_layer_end_index", i > d["moe_layer_end_index"]))
    for k in (
        "decoder_sparse_step",
        "interleave_moe_layer_step",
        "moe_layer_interval",
        "no_rope_layer_interval",
        "moe_layer_freq",
        "sliding_window_pattern",
        "_sliding_window_pattern",
        "global_attn_every_n_layers",
        "layer_group_size",
    ):
        if _is_int(d.get(k)) and d[k] > 1:
            for i in range(n):
                sigs[i].append((k, (i + 1) % d[k] == 0))
    for k in d:
        # Jamba-style `attn_layer_period`/`_offset` generate the pattern only when no explicit list is
        # given (Zamba's defaults carry both, and disagree: the list is what the model builds).
        if k.endswith("_period") and _is_int(d[k]) and d[k] > 1 and not per_layer:
            offset = d.get(k.replace("_period", "_offset"), 0) or 0
            for i in range(n):
                sigs[i].append((k, i % d[k] == offset))
    per_layer_cfg = d.get("per_layer_config") or {}
    for key, overrides in per_layer_cfg.items():
        i = int(key)
        if 0 <= i < n:
            sigs[i].append(("per_layer_config", repr(sorted(overrides.items()))))
    return [tuple(s) for s in sigs]


def _choose_layers(sigs: list[tuple], minimum: int = 2) -> list[int]:
    """Indices of the layers to keep, at most MAX_LAYERS when possible, in this order of preference:
    two layers of every kind (blocks shared or tied across the layers of a kind, such as Zamba's
    shared transformer or KV sharing, exist only with two), as a prefix of the model (periodic
    rules such as `decoder_sparse_step` stay true) or else as the first two of each kind; then one
    of every kind, as a prefix or the first of each kind."""
    n = len(sigs)
    kinds = list(dict.fromkeys(sigs))
    count = {k: sigs.count(k) for k in kinds}

    def prefix_with(instances: int) -> int:
        seen: dict = {}
        for i, s in enumerate(sigs):
            seen[s] = seen.get(s, 0) + 1
            if all(seen.get(k, 0) >= min(instances, count[k]) for k in kinds):
                return i + 1
        return n

    def first(instances: int) -> list[int]:
        keep = []
        for k in kinds:
            keep += [i for i, s in enumerate(sigs) if s == k][:instances]
        return sorted(keep)

    for instances in (2, 1):
        p = max(minimum, prefix_with(instances))
        if p <= MAX_LAYERS or p >= n:
            return list(range(min(n, p)))
        keep = first(instances)
        if len(keep) <= MAX_LAYERS or instances == 1:
            for i in range(n):  # at least `minimum` layers
                if len(keep) >= minimum:
                    break
                if i not in keep:
                    keep.append(i)
            return sorted(keep)
    return list(range(min(n, minimum)))


def _reindex_layers(d: dict, n: int, keep: list[int], per_layer: list[str], index_lists: list[str]) -> dict:
    """Every per-layer attribute re-indexed to the kept layers."""
    up: dict[str, Any] = {}
    new_n = len(keep)
    prefix = keep == list(range(new_n))
    for k in per_layer:
        v = d[k]
        picked = (
            [keep.index(v[i]) if v[i] in keep else j for j, i in enumerate(keep)] if _is_pointer_list(k, v, n) else [v[i] for i in keep]
        )
        up[k] = "".join(picked) if isinstance(v, str) else type(v)(picked) if isinstance(v, tuple) else picked
    for k in index_lists:
        up[k] = [keep.index(i) for i in d[k] if i in keep]
    for k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if _is_int(d.get(k)) and d[k] > 0:
            up[k] = sum(1 for i in keep if i < d[k])
    if _is_int(d.get("moe_layer_end_index")) and d["moe_layer_end_index"] >= 0:
        up["moe_layer_end_index"] = max([j for j, i in enumerate(keep) if i <= d["moe_layer_end_index"]], default=-1)
    if not prefix:
        # Periodic rules can't describe an arbitrary subset: re-derive the period from the kept
        # layers when they form one (kind at the end of each period), else leave the explicit lists to speak.
        for k in (
            "sliding_window_pattern",
            "_sliding_window_pattern",
            "no_rope_layer_interval",
            "global_attn_every_n_layers",
            "decoder_sparse_step",
            "interleave_moe_layer_step",
            "moe_layer_interval",
            "layer_group_size",
        ):
            if _is_int(d.get(k)) and d[k] > 1:
                flags = [(i + 1) % d[k] == 0 for i in keep]
                up[k] = flags.index(True) + 1 if True in flags else new_n + 1
        for k in list(d):
            if k.endswith("_period") and _is_int(d[k]) and d[k] > 1 and not per_layer:
                off_key = k.replace("_period", "_offset")
                offset = d.get(off_key, 0) or 0
                flags = [i % d[k] == offset for i in keep]
                if True in flags:
                    first = flags.index(True)
                    up[k], up[off_key] = new_n, first  # the one kept layer of that kind
                    if off_key not in d:
                        up.pop(off_key)
    if _is_int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:
        up["num_kv_shared_layers"] = sum(1 for i in keep if i >= n - d["num_kv_shared_layers"])
    if d.get("per_layer_config"):
        up["per_layer_config"] = {f"{keep.index(int(key)):02d}": v for key, v in d["per_layer_config"].items() if int(key) in keep}
    return up


# --- one config level ------------------------------------------------------------------------------
class _Ties:
    """Original value -> new value of the primary dimensions, shared across the config tree, so an
    attribute elsewhere that equals one of them (a projector's output = text hidden size) follows."""

    def __init__(self):
        self.values: dict[int, int] = {}
        self.tower_depth: tuple[int, int] | None = None  # (old, new) layers of the vision tower

    def add(self, old, new) -> None:
        if _is_int(old) and _is_int(new) and old > 16 and old not in self.values:
            self.values[old] = new


def _shrink_level(config, ties: _Ties, vocab: int, role: str, extra_tokens: dict[str, int]) -> dict:
    """Updates for one config (sub-configs excluded). `role`: 'text' or 'tower' (vision/audio/...)."""
    d = config.to_dict()
    canon = _canonical_names(config)

    def name(k):
        return canon.get(k, k)

    sub_keys = set((getattr(config, "sub_configs", None) or {}).keys())
    up: dict[str, Any] = {}
    handled: set[str] = set()

    def setv(k, v):
        up[k] = v
        handled.add(k)

    hidden = HIDDEN if role == "text" else VISION_HIDDEN
    # Layer count and pattern.
    layer_keys = [k for k in d if name(k) in LAYER_COUNT and _is_int(d[k]) and d[k] > 0]
    for k in layer_keys:
        n = d[k]
        if name(k) in ("num_hidden_layers", "num_layers", "n_layers", "n_layer", "depth", "num_blocks") and k == layer_keys[0]:
            per_layer = _per_layer_lists(d, n)
            index_lists = _index_lists(d, n, per_layer)
            if role == "text":
                keep = _choose_layers(_layer_signatures(d, n, per_layer, index_lists))
                for p in per_layer:  # a kept layer that reads another layer's state keeps that layer too
                    if _is_pointer_list(p, d[p], n):
                        keep = sorted(set(keep) | {d[p][i] for i in keep})
            else:
                keep = list(range(min(n, 2)))
            up.update(_reindex_layers(d, n, keep, per_layer, index_lists))
            handled.update(per_layer + index_lists)
            setv(k, len(keep))
            if role != "text":
                _remap_tower_indices(d, n, len(keep), up, handled, per_layer + index_lists)
                if ties.tower_depth is None:
                    ties.tower_depth = (n, len(keep))
        else:
            setv(k, min(d[k], 2))
    # Widths.
    orig_heads = next((d[k] for k in d if name(k) == "num_attention_heads" and _is_int(d[k])), None)
    orig_hidden = next((d[k] for k in d if name(k) in HIDDEN_KEYS and _is_int(d[k])), None)
    for k, v in d.items():
        c = name(k)
        if k in sub_keys or k in handled or k in KEEP:
            continue
        if v is None and c == "head_dim" and orig_hidden and orig_heads:
            setv(k, HEAD_DIM)  # some defaults leave it None and then fail to derive it (hunyuan, ministral)
            continue
        if v is None and c in TOP_K_KEYS and any(_is_int(d.get(e)) and d[e] > 1 for e in d if name(e) in EXPERT_KEYS):
            setv(k, TOP_K)  # DeepSeek-V2's default has experts but no top-k
            continue
        if v is None and c in EXPERT_INTERMEDIATE_KEYS[:2] and any(_is_int(d.get(e)) and d[e] > 1 for e in d if name(e) in EXPERT_KEYS):
            setv(k, EXPERT_INTERMEDIATE)  # dots1's default: experts without a size
            continue
        if v is None and c == "num_key_value_heads" and orig_heads:
            setv(k, HEADS)  # None means "as many as query heads", which some defaults then fail to derive (nemotron)
            continue
        if not _is_int(v) or v == 0:
            continue  # zero means absent (qk_rope_head_dim=0: NoPE; shared_intermediate_size=0: no shared expert)
        if c in HIDDEN_KEYS:
            setv(k, hidden)
            ties.add(v, hidden)
        elif c in INTERMEDIATE_KEYS:
            setv(k, INTERMEDIATE if v > 0 else v)
            ties.add(v, INTERMEDIATE)
        elif c in EXPERT_INTERMEDIATE_KEYS:
            setv(k, EXPERT_INTERMEDIATE if v > 0 else v)
        elif c in HEAD_KEYS:
            setv(k, HEADS)
        elif c in KV_HEAD_KEYS:
            heads_key = "swa_num_attention_heads" if k.startswith("swa_") else "num_attention_heads"
            setv(k, _kv_heads(d.get(heads_key, orig_heads), v))
        elif c in HEAD_DIM_KEYS:
            setv(k, HEAD_DIM)
        elif c in EXPERT_KEYS:
            setv(k, min(v, EXPERTS))
        elif c in TOP_K_KEYS:
            setv(k, min(v, TOP_K))
        elif c in SHARED_EXPERT_KEYS or c in GROUP_KEYS:
            setv(k, min(v, 2))
        elif c == "topk_group":
            setv(k, 1 if (d.get("n_group") or d.get("num_expert_group") or 1) > 1 else v)
        elif c in MLA:
            setv(k, MLA[c])
        elif c in LINEAR_ATTENTION:
            setv(k, LINEAR_ATTENTION[c])
        elif c in WINDOW_KEYS and v > WINDOW:
            setv(k, WINDOW)
        elif c in POSITION_KEYS and v > MAX_POSITIONS:
            setv(k, MAX_POSITIONS)
        elif c == "vocab_size" and role == "text":
            setv(k, vocab)
            ties.add(v, vocab)
        elif c in ("vocab_size_per_layer_input",) and role == "text":
            setv(k, vocab)
        elif c in ("index_topk",):
            setv(k, min(v, WINDOW))
        elif c in ("index_n_heads",):
            setv(k, 2)
        elif c in ("index_head_dim",):
            setv(k, HEAD_DIM)
    # Derived MLA sizes.
    if "qk_head_dim" in d and "qk_nope_head_dim" in up:
        setv("qk_head_dim", up["qk_nope_head_dim"] + up.get("qk_rope_head_dim", d.get("qk_rope_head_dim") or 0))
    if "head_dim" in d and "qk_rope_head_dim" in up and d.get("head_dim") == d.get("qk_rope_head_dim"):
        setv("head_dim", up["qk_rope_head_dim"])  # DeepSeek-style: rotary head_dim is the rope part
    # Linear attention: keep the value/key head ratio.
    if _is_int(d.get("linear_num_key_heads")):
        k_heads = 2
        ratio = max(1, (d.get("linear_num_value_heads") or d["linear_num_key_heads"]) // d["linear_num_key_heads"])
        setv("linear_num_key_heads", k_heads)
        if "linear_num_value_heads" in d:
            setv("linear_num_value_heads", k_heads * ratio)
    if _is_int(d.get("linear_num_heads")):
        setv("linear_num_heads", 2)
    _shrink_ssm(d, up, handled, hidden)
    # Token ids: the tiny tokenizer's specials, and reserved ids above its vocabulary for the rest.
    for k, v in d.items():
        if k in handled or k in sub_keys:
            continue
        if k in TEXT_TOKEN_IDS and v is not None:
            new = TEXT_TOKEN_IDS[k]
            setv(k, [new] if isinstance(v, list) else new)
        elif (
            (k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("token_ids"))
            and v is not None
            and (_is_int(v) or isinstance(v, list))
        ):
            vals = v if isinstance(v, list) else [v]
            mapped = [extra_tokens.setdefault(f"{k}:{x}", vocab + len(extra_tokens)) for x in vals if _is_int(x)]
            setv(k, mapped if isinstance(v, list) else mapped[0])
    # Whatever equals a dimension we changed elsewhere follows it; other widths scale with hidden.
    for k, v in d.items():
        if k in handled or k in sub_keys or not _is_int(v) or k in KEEP or k.endswith(("_token_id", "_token_index")):
            continue
        if v in ties.values and v > 16 and re.search(r"(size|dim|hidden|width|channels|features|rank|vocab_size)$", k):
            setv(k, ties.values[v])
        elif (
            orig_hidden
            and re.search(r"(size|dim|width|hidden|channels|rank)$", k)
            and v >= 64
            and not re.search(r"(image|patch|vocab|chunk|window|kernel|position|block|bucket|max|seq|pool|grid|codebook|embeddings)", k)
        ):
            setv(k, max(8, int(round(v * hidden / orig_hidden / 8)) * 8))
    if ties.tower_depth and role != "tower-self":
        old, new = ties.tower_depth
        for k, v in d.items():
            if k in handled or not re.search(r"(feature_layers?|select_layer)$", k):
                continue
            if _is_int(v) and -old <= v < old:
                setv(k, _scale_index(v, old, new))
            elif isinstance(v, list) and v and all(_is_int(x) and -old <= x < old for x in v):
                setv(k, [_scale_index(x, old, new) for x in v])
    plc = up.get("per_layer_config", d.get("per_layer_config"))
    if plc:
        # Per-layer overrides keep their ratio to the global value (head_dim 512 where the global is 256 -> 2 x 16).
        scaled = {}
        for key, overrides in plc.items():
            scaled[key] = {
                a: (max(1, round(up[a] * val / d[a])) if _is_int(val) and _is_int(d.get(a)) and d[a] and _is_int(up.get(a)) else val)
                for a, val in overrides.items()
            }
        up["per_layer_config"] = scaled
    _shrink_rope(d, up, config)
    return up


def _remap_tower_indices(d: dict, old: int, new: int, up: dict, handled: set, skip: list[str]) -> None:
    """Layer-index lists of a vision/audio tower (fullatt_block_indexes, deepstack_visual_indexes,
    vision_feature_layer(s), global_attn_indexes, ...) mapped onto its new depth."""
    for k, v in d.items():
        if k in skip or k in handled or "token" in k:
            continue
        if not re.search(r"(index|indexes|indices|idxs|layer|layers|layer_ids)$", k):
            continue
        if _is_int(v) and -old <= v < old and k.endswith(("feature_layer", "select_layer", "layer_idx", "insert_layer_id")):
            up[k] = _scale_index(v, old, new)
            handled.add(k)
        elif isinstance(v, list) and v and all(_is_int(x) and -old <= x < old for x in v):
            up[k] = [_scale_index(x, old, new) for x in v]
            handled.add(k)


def _shrink_ssm(d: dict, up: dict, handled: set, hidden: int) -> None:
    """Mamba / Mamba-2 / hybrid SSM blocks: heads x head_dim = expand x hidden must keep holding;
    groups divide heads; small state and chunk so chunked scans run more than one chunk."""
    pairs = [
        ("mamba_n_heads", "mamba_d_head"),
        ("mamba_num_heads", "mamba_head_dim"),
        ("num_heads", "head_dim"),
        ("n_mamba_heads", "mamba_headdim"),
    ]
    expand = d.get("mamba_expand") or d.get("expand") or 2
    for heads_key, dim_key in pairs:
        if _is_int(d.get(heads_key)) and _is_int(d.get(dim_key)) and ("mamba" in heads_key or "state_size" in d or "ssm_state_size" in d):
            inner = int(expand * hidden)
            head_dim = HEAD_DIM if inner % HEAD_DIM == 0 else 8
            up[heads_key], up[dim_key] = inner // head_dim, head_dim
            handled.update((heads_key, dim_key))
    if d.get("mamba_d_ssm"):
        up["mamba_d_ssm"] = int(expand * hidden)
        handled.add("mamba_d_ssm")
    for k in ("mamba_n_groups", "n_groups", "mamba_ngroups"):
        if _is_int(d.get(k)) and d[k] > 1 and ("mamba" in k or "state_size" in d or "ssm_state_size" in d):
            up[k] = 2
            handled.add(k)
    for k in ("mamba_d_state", "state_size", "ssm_state_size"):
        if _is_int(d.get(k)) and d[k] > 16:
            up[k] = 16
            handled.add(k)
    for k in ("mamba_chunk_size", "chunk_size"):
        if (
            _is_int(d.get(k))
            and d[k] > 16
            and (k.startswith("mamba") or "state_size" in d or "ssm_state_size" in d or "mamba_d_state" in d)
        ):
            up[k] = 16
            handled.add(k)
    for k in ("mamba_dt_rank", "time_step_rank"):
        if _is_int(d.get(k)) and d[k] > 8:
            up[k] = 8
            handled.add(k)


def _shrink_rope(d: dict, up: dict, config) -> None:
    """RoPE parameters whose shapes follow head_dim: mrope sections (sum = rotary dim / 2),
    LongRoPE factor lists (rotary dim / 2 entries)."""
    rope = d.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    new_hd = up.get("head_dim") or (up.get("hidden_size", HIDDEN) // max(1, up.get("num_attention_heads") or HEADS))
    if "qk_rope_head_dim" in up:
        new_hd = up["qk_rope_head_dim"]

    def fix(p: dict) -> dict:
        p = dict(p)
        for key, val in list(p.items()):
            if key in ("mrope_section",) and isinstance(val, list) and sum(val) > 0:
                total = max(len(val), (new_hd * (p.get("partial_rotary_factor") or 1.0)) // 2)
                parts = [max(1, int(x * total / sum(val))) for x in val]
                parts[0] += int(total - sum(parts))
                p[key] = parts
            elif key in ("short_factor", "long_factor") and isinstance(val, list):
                p[key] = val[: max(1, int(new_hd * (p.get("partial_rotary_factor") or 1.0)) // 2)]
            elif key == "original_max_position_embeddings" and _is_int(val) and val > MAX_POSITIONS:
                p[key] = max(16, MAX_POSITIONS // int(p.get("factor") or 1))
        return p

    if all(isinstance(v, dict) for v in rope.values()) and rope:
        new = {k: fix(v) for k, v in rope.items()}
    else:
        new = fix(rope)
        # Families whose config declares mrope_section as a rope key (ignore_keys_at_rope_validation) fall back
        # to a section sized for the full model in their modeling code when the config has none: give one.
        if "mrope_section" in (getattr(type(config), "ignore_keys_at_rope_validation", None) or ()) and "mrope_section" not in new:
            half = int(new_hd * (new.get("partial_rotary_factor") or 1.0)) // 2
            new = {**new, "mrope_section": [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]}
    if new != rope:
        up["rope_parameters"] = new


TEXT_SUBS = ("text_config", "llm_config", "decoder_config", "language_config", "encoder_config")


# --- the tree ----------------------------------------------------------------------------------------
def _sub_config_items(config) -> list[tuple[str, Any]]:
    items = []
    for key in getattr(config, "sub_configs", None) or {}:
        try:
            value = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - heterogeneous configs refuse some global reads
            value = None
        if isinstance(value, PreTrainedConfig):
            items.append((key, value))
    return items


def _rebuild(config, updates: dict, subs: dict):
    """A new config of the same class from the old one's dict plus `updates` and rebuilt sub-configs."""
    d = config.to_dict()
    d.update(updates)
    for key, sub in subs.items():
        d[key] = sub.to_dict()
    d.pop("transformers_version", None)
    return type(config).from_dict(d)


def _shrink_tree(config, ties: _Ties, vocab: int, role: str, extra_tokens: dict) -> Any:
    subs = dict(_sub_config_items(config))
    # Text first: its dimensions are the ones projectors elsewhere must match.
    order = sorted(subs, key=lambda k: (0 if k in TEXT_SUBS else 1 if k == "vision_config" else 2, k))
    new_subs = {}
    for key in order:
        sub_role = "text" if key in TEXT_SUBS else "tower"
        new_subs[key] = _shrink_tree(subs[key], ties, vocab, sub_role, extra_tokens)
    up = _shrink_level(config, ties, vocab, role, extra_tokens)
    return _rebuild(config, up, new_subs)


def shrink_config(config, vocab_size: int = TEXT_VOCAB, overrides: dict | None = None):
    """The smallest config of `config`'s family that keeps its structure (see the module doc).

    `vocab_size`: the text vocabulary (512 = lora_tune.models.tiny_model.train_tiny_tokenizer()); the
    multimodal special tokens get ids just above it and the embedding grows to hold them.
    `overrides`: extra top-level updates, applied last (after OVERRIDES[model_type])."""
    config = copy.deepcopy(config)
    extra_tokens: dict[str, int] = {}
    ties = _Ties()
    has_text = any(k in ("text_config", "llm_config", "language_config") for k, _ in _sub_config_items(config))
    small = _shrink_tree(config, ties, vocab_size, "tower" if has_text else "text", extra_tokens)
    if extra_tokens:
        # The embedding must hold the reserved ids: widen every text vocab to the next multiple of 8.
        total = vocab_size + len(extra_tokens)
        total += -total % 8
        small = _set_vocab(small, vocab_size, total)
    fixes = dict(OVERRIDES.get(getattr(config, "model_type", ""), {}))
    fixes.update(overrides or {})
    if fixes:
        d = small.to_dict()
        for key, value in fixes.items():
            _set_path(d, key, value)
        d.pop("transformers_version", None)
        small = type(small).from_dict(d)
    return small


def _set_vocab(config, old: int, new: int):
    d = config.to_dict()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("vocab_size", "vocab_size_per_layer_input") and v == old:
                    x[k] = new
                else:
                    walk(v)

    walk(d)
    d.pop("transformers_version", None)
    return type(config).from_dict(d)


def _set_path(d: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d[p]
    d[parts[-1]] = value


__all__ = ["OVERRIDES", "shrink_config"]
