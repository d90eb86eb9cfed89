"""Which layers a tiny twin keeps: every distinct kind of layer the config describes (per-layer
lists, layer-index lists, dense-first counts, periodic rules, per-layer overrides), in 2 to
MAX_LAYERS layers, and every per-layer attribute re-indexed to them."""

from __future__ import annotations

import re
from typing import Any

MAX_LAYERS = 4


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def scale_index(i: int, old: int, new: int) -> int:
    """Map a layer index of a `old`-layer stack onto a `new`-layer one (negative indices too)."""
    negative = i < 0
    j = i + old if negative else i
    j = min(new - 1, max(0, round(j * (new - 1) / max(1, old - 1))))
    return j - new if negative else j


INDEX_LIST_HINT = re.compile(r"(layers|idxs|indexes|indices|layer_ids|_ids)$")


def is_index_list(k: str, v, n: int) -> bool:
    """A list of distinct layer indices (mlp_only_layers, full_attn_idxs, moe_layers, hybrid_layer_ids...)."""
    return (
        isinstance(v, (list, tuple))
        and bool(INDEX_LIST_HINT.search(k))
        and "token" not in k
        and all(is_int(x) and 0 <= x < n for x in v)
        and len(set(v)) == len(v)
    )


def is_pointer_list(k: str, v, n: int) -> bool:
    """One layer index per layer: the layer whose state this one reads (kv_source_layers)."""
    return (
        isinstance(v, (list, tuple)) and len(v) == n and "layer" in k and all(is_int(x) and 0 <= x < n for x in v) and len(set(v)) < len(v)
    )


def per_layer_lists(d: dict, n: int) -> list[str]:
    """Attributes holding one entry per layer (lists or strings as long as the model)."""
    out = []
    for k, v in d.items():
        if k in ("id2label", "label2id") or k.endswith("_config") or is_index_list(k, v, n):
            continue
        if isinstance(v, (list, tuple)) and len(v) == n and n > 1:
            out.append(k)
        elif isinstance(v, str) and len(v) == n and n > 2 and k.endswith(("pattern", "_types")):
            out.append(k)  # e.g. nemotron's hybrid_override_pattern "M-M-M*-..."
    return out


def index_lists(d: dict, n: int, per_layer: list[str]) -> list[str]:
    return [k for k, v in d.items() if k not in per_layer and is_index_list(k, v, n)]


def layer_signatures(d: dict, n: int, per_layer: list[str], index_lists: list[str]) -> list[tuple]:
    """One signature per layer: everything the config says differs between layers."""
    sigs: list[list] = [[] for _ in range(n)]
    for k in per_layer:
        pointer = is_pointer_list(k, d[k], n)
        for i in range(n):
            sigs[i].append((k, d[k][i] == i if pointer else repr(d[k][i])))
    if is_int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:
        for i in range(n):  # the last k layers reuse earlier layers' keys/values
            sigs[i].append(("num_kv_shared_layers", i >= n - d["num_kv_shared_layers"]))
    for k in index_lists:
        members = set(d[k])
        for i in range(n):
            sigs[i].append((k, i in members))
    for k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if is_int(d.get(k)) and d[k] > 0:
            for i in range(n):
                sigs[i].append((k, i < d[k]))
    if is_int(d.get("moe_layer_end_index")) and d["moe_layer_end_index"] >= 0:
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
        if is_int(d.get(k)) and d[k] > 1:
            for i in range(n):
                sigs[i].append((k, (i + 1) % d[k] == 0))
    for k in d:
        # Jamba-style `attn_layer_period`/`_offset` generate the pattern only when no explicit list is
        # given (Zamba's defaults carry both, and disagree: the list is what the model builds).
        if k.endswith("_period") and is_int(d[k]) and d[k] > 1 and not per_layer:
            offset = d.get(k.replace("_period", "_offset"), 0) or 0
            for i in range(n):
                sigs[i].append((k, i % d[k] == offset))
    per_layer_cfg = d.get("per_layer_config") or {}
    for key, overrides in per_layer_cfg.items():
        i = int(key)
        if 0 <= i < n:
            sigs[i].append(("per_layer_config", repr(sorted(overrides.items()))))
    return [tuple(s) for s in sigs]


def choose_layers(sigs: list[tuple], minimum: int = 2) -> list[int]:
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


def reindex_layers(d: dict, n: int, keep: list[int], per_layer: list[str], index_lists: list[str]) -> dict:
    """Every per-layer attribute re-indexed to the kept layers."""
    up: dict[str, Any] = {}
    new_n = len(keep)
    prefix = keep == list(range(new_n))
    for k in per_layer:
        v = d[k]
        picked = [keep.index(v[i]) if v[i] in keep else j for j, i in enumerate(keep)] if is_pointer_list(k, v, n) else [v[i] for i in keep]
        up[k] = "".join(picked) if isinstance(v, str) else type(v)(picked) if isinstance(v, tuple) else picked
    for k in index_lists:
        up[k] = [keep.index(i) for i in d[k] if i in keep]
    for k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if is_int(d.get(k)) and d[k] > 0:
            up[k] = sum(1 for i in keep if i < d[k])
    if is_int(d.get("moe_layer_end_index")) and d["moe_layer_end_index"] >= 0:
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
            if is_int(d.get(k)) and d[k] > 1:
                flags = [(i + 1) % d[k] == 0 for i in keep]
                up[k] = flags.index(True) + 1 if True in flags else new_n + 1
        for k in list(d):
            if k.endswith("_period") and is_int(d[k]) and d[k] > 1 and not per_layer:
                off_key = k.replace("_period", "_offset")
                offset = d.get(off_key, 0) or 0
                flags = [i % d[k] == offset for i in keep]
                if True in flags:
                    first = flags.index(True)
                    up[k], up[off_key] = new_n, first  # the one kept layer of that kind
                    if off_key not in d:
                        up.pop(off_key)
    if is_int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:
        up["num_kv_shared_layers"] = sum(1 for i in keep if i >= n - d["num_kv_shared_layers"])
    if d.get("per_layer_config"):
        up["per_layer_config"] = {f"{keep.index(int(key)):02d}": v for key, v in d["per_layer_config"].items() if int(key) in keep}
    return up


def remap_tower_indices(d: dict, old: int, new: int, up: dict, handled: set, skip: list[str]) -> None:
    """Layer-index lists of a vision/audio tower (fullatt_block_indexes, deepstack_visual_indexes,
    vision_feature_layer(s), global_attn_indexes, ...) mapped onto its new depth."""
    for k, v in d.items():
        if k in skip or k in handled or "token" in k:
            continue
        if not re.search(r"(index|indexes|indices|idxs|layer|layers|layer_ids)$", k):
            continue
        if is_int(v) and -old <= v < old and k.endswith(("feature_layer", "select_layer", "layer_idx", "insert_layer_id")):
            up[k] = scale_index(v, old, new)
            handled.add(k)
        elif isinstance(v, list) and v and all(is_int(x) and -old <= x < old for x in v):
            up[k] = [scale_index(x, old, new) for x in v]
            handled.add(k)


def shrink_layers(d: dict, n: int, role: str) -> tuple[list[int], dict, list[str]]:
    """The layers kept of an `n`-layer stack (config dict `d`): one of every kind for the text
    model ('text'), the first two for a tower; (kept, per-layer attributes re-indexed to them, the
    attributes that covers)."""
    per_layer = per_layer_lists(d, n)
    indices = index_lists(d, n, per_layer)
    if role == "text":
        keep = choose_layers(layer_signatures(d, n, per_layer, indices))
        for p in per_layer:  # a kept layer that reads another layer's state keeps that layer too
            if is_pointer_list(p, d[p], n):
                keep = sorted(set(keep) | {d[p][i] for i in keep})
    else:
        keep = list(range(min(n, 2)))
    return keep, reindex_layers(d, n, keep, per_layer, indices), per_layer + indices
