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
* a small vocabulary (`vocab_size`, default 512 = `lora_tune.models.tiny.model.train_tiny_tokenizer()`)
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

from lora_tune.models.tiny.geometry import shrink_rope, shrink_ssm
from lora_tune.models.tiny.layers import is_int, remap_tower_indices, scale_index, shrink_layers
from lora_tune.models.tiny.sizes import (
    EXPERT_INTERMEDIATE,
    EXPERT_INTERMEDIATE_KEYS,
    EXPERT_KEYS,
    EXPERTS,
    GROUP_KEYS,
    HEAD_DIM,
    HEAD_DIM_KEYS,
    HEAD_KEYS,
    HEADS,
    HIDDEN,
    HIDDEN_KEYS,
    INTERMEDIATE,
    INTERMEDIATE_KEYS,
    KV_HEAD_KEYS,
    LAYER_COUNT,
    LINEAR_ATTENTION,
    MAX_POSITIONS,
    MLA,
    POSITION_KEYS,
    SHARED_EXPERT_KEYS,
    TEXT_VOCAB,
    TOP_K,
    TOP_K_KEYS,
    VISION_HIDDEN,
    WINDOW,
    WINDOW_KEYS,
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


# --- one config level ------------------------------------------------------------------------------
class _Ties:
    """Original value -> new value of the primary dimensions, shared across the config tree, so an
    attribute elsewhere that equals one of them (a projector's output = text hidden size) follows."""

    def __init__(self):
        self.values: dict[int, int] = {}
        self.tower_depth: tuple[int, int] | None = None  # (old, new) layers of the vision tower

    def add(self, old, new) -> None:
        if is_int(old) and is_int(new) and old > 16 and old not in self.values:
            self.values[old] = new


class _Level:
    """One config of the tree being shrunk (its sub-configs excluded): its attributes, the updates so
    far, and the attributes they cover (which later rules leave alone)."""

    def __init__(self, config, role: str):
        self.config, self.role = config, role
        self.d = config.to_dict()
        self.canon = _canonical_names(config)
        self.sub_keys = set((getattr(config, "sub_configs", None) or {}).keys())
        self.up: dict[str, Any] = {}
        self.handled: set[str] = set()
        self.hidden = HIDDEN if role == "text" else VISION_HIDDEN
        name = self.name
        self.orig_heads = next((v for k, v in self.d.items() if name(k) == "num_attention_heads" and is_int(v)), None)
        self.orig_hidden = next((v for k, v in self.d.items() if name(k) in HIDDEN_KEYS and is_int(v)), None)

    def name(self, k: str) -> str:
        return self.canon.get(k, k)

    def set(self, k: str, v) -> None:
        self.up[k] = v
        self.handled.add(k)


def _shrink_level(config, ties: _Ties, vocab: int, role: str, extra_tokens: dict[str, int]) -> dict:
    """Updates for one config (sub-configs excluded). `role`: 'text' or 'tower' (vision/audio/...)."""
    level = _Level(config, role)
    _shrink_depth(level, ties)
    _shrink_widths(level, ties, vocab)
    _derived_sizes(level)
    shrink_ssm(level.d, level.up, level.handled, level.hidden)
    _token_ids(level, vocab, extra_tokens)
    _follow_ties(level, ties)
    _per_layer_overrides(level)
    shrink_rope(level.d, level.up, config)
    return level.up


def _shrink_depth(level: _Level, ties: _Ties) -> None:
    """The layer count and pattern (lora_tune.models.tiny.layers)."""
    d, up, handled, name, setv = level.d, level.up, level.handled, level.name, level.set
    role = level.role
    layer_keys = [k for k in d if name(k) in LAYER_COUNT and is_int(d[k]) and d[k] > 0]
    for k in layer_keys:
        n = d[k]
        if name(k) in ("num_hidden_layers", "num_layers", "n_layers", "n_layer", "depth", "num_blocks") and k == layer_keys[0]:
            keep, reindexed, covered = shrink_layers(d, n, role)
            up.update(reindexed)
            handled.update(covered)
            setv(k, len(keep))
            if role != "text":
                remap_tower_indices(d, n, len(keep), up, handled, covered)
                if ties.tower_depth is None:
                    ties.tower_depth = (n, len(keep))
        else:
            setv(k, min(d[k], 2))


def _shrink_widths(level: _Level, ties: _Ties, vocab: int) -> None:
    """Hidden, intermediate, head, expert, window and position sizes, by their canonical names."""
    d, handled, name, setv = level.d, level.handled, level.name, level.set
    sub_keys, hidden, role, orig_heads, orig_hidden = level.sub_keys, level.hidden, level.role, level.orig_heads, level.orig_hidden
    for k, v in d.items():
        c = name(k)
        if k in sub_keys or k in handled or k in KEEP:
            continue
        if v is None and c == "head_dim" and orig_hidden and orig_heads:
            setv(k, HEAD_DIM)  # some defaults leave it None and then fail to derive it (hunyuan, ministral)
            continue
        if v is None and c in TOP_K_KEYS and any(is_int(d.get(e)) and d[e] > 1 for e in d if name(e) in EXPERT_KEYS):
            setv(k, TOP_K)  # DeepSeek-V2's default has experts but no top-k
            continue
        if v is None and c in EXPERT_INTERMEDIATE_KEYS[:2] and any(is_int(d.get(e)) and d[e] > 1 for e in d if name(e) in EXPERT_KEYS):
            setv(k, EXPERT_INTERMEDIATE)  # dots1's default: experts without a size
            continue
        if v is None and c == "num_key_value_heads" and orig_heads:
            setv(k, HEADS)  # None means "as many as query heads", which some defaults then fail to derive (nemotron)
            continue
        if not is_int(v) or v == 0:
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


def _derived_sizes(level: _Level) -> None:
    """Sizes derived from others: MLA's, and linear attention's head ratio."""
    d, up, setv = level.d, level.up, level.set
    # MLA.
    if "qk_head_dim" in d and "qk_nope_head_dim" in up:
        setv("qk_head_dim", up["qk_nope_head_dim"] + up.get("qk_rope_head_dim", d.get("qk_rope_head_dim") or 0))
    if "head_dim" in d and "qk_rope_head_dim" in up and d.get("head_dim") == d.get("qk_rope_head_dim"):
        setv("head_dim", up["qk_rope_head_dim"])  # DeepSeek-style: rotary head_dim is the rope part
    # Linear attention: keep the value/key head ratio.
    if is_int(d.get("linear_num_key_heads")):
        k_heads = 2
        ratio = max(1, (d.get("linear_num_value_heads") or d["linear_num_key_heads"]) // d["linear_num_key_heads"])
        setv("linear_num_key_heads", k_heads)
        if "linear_num_value_heads" in d:
            setv("linear_num_value_heads", k_heads * ratio)
    if is_int(d.get("linear_num_heads")):
        setv("linear_num_heads", 2)


def _token_ids(level: _Level, vocab: int, extra_tokens: dict[str, int]) -> None:
    """The tiny tokenizer's specials, and reserved ids above its vocabulary for the rest."""
    d, handled, setv = level.d, level.handled, level.set
    sub_keys = level.sub_keys
    for k, v in d.items():
        if k in handled or k in sub_keys:
            continue
        if k in TEXT_TOKEN_IDS and v is not None:
            new = TEXT_TOKEN_IDS[k]
            setv(k, [new] if isinstance(v, list) else new)
        elif (
            (k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("token_ids"))
            and v is not None
            and (is_int(v) or isinstance(v, list))
        ):
            vals = v if isinstance(v, list) else [v]
            mapped = [extra_tokens.setdefault(f"{k}:{x}", vocab + len(extra_tokens)) for x in vals if is_int(x)]
            setv(k, mapped if isinstance(v, list) else mapped[0])


def _follow_ties(level: _Level, ties: _Ties) -> None:
    """Whatever equals a dimension changed elsewhere follows it; other widths scale with hidden; a
    tower's feature-layer indices follow its new depth."""
    d, handled, setv = level.d, level.handled, level.set
    sub_keys, hidden, role, orig_hidden = level.sub_keys, level.hidden, level.role, level.orig_hidden
    for k, v in d.items():
        if k in handled or k in sub_keys or not is_int(v) or k in KEEP or k.endswith(("_token_id", "_token_index")):
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
            if is_int(v) and -old <= v < old:
                setv(k, scale_index(v, old, new))
            elif isinstance(v, list) and v and all(is_int(x) and -old <= x < old for x in v):
                setv(k, [scale_index(x, old, new) for x in v])


def _per_layer_overrides(level: _Level) -> None:
    """Per-layer overrides keep their ratio to the global value (head_dim 512 where the global is 256 -> 2 x 16)."""
    d, up = level.d, level.up
    plc = up.get("per_layer_config", d.get("per_layer_config"))
    if plc:
        # Per-layer overrides keep their ratio to the global value (head_dim 512 where the global is 256 -> 2 x 16).
        scaled = {}
        for key, overrides in plc.items():
            scaled[key] = {
                a: (max(1, round(up[a] * val / d[a])) if is_int(val) and is_int(d.get(a)) and d[a] and is_int(up.get(a)) else val)
                for a, val in overrides.items()
            }
        up["per_layer_config"] = scaled


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

    `vocab_size`: the text vocabulary (512 = lora_tune.models.tiny.model.train_tiny_tokenizer()); the
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
