"""Shapes that must stay consistent when a family shrinks: SSM blocks (heads x head_dim = expand x
hidden, groups dividing heads) and RoPE parameters that follow head_dim (mrope sections, LongRoPE
factor lists)."""

from __future__ import annotations

from lora_tune.models.tiny.layers import is_int
from lora_tune.models.tiny.sizes import HEAD_DIM, HEADS, HIDDEN, MAX_POSITIONS


def shrink_ssm(d: dict, up: dict, handled: set, hidden: int) -> None:
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
        if is_int(d.get(heads_key)) and is_int(d.get(dim_key)) and ("mamba" in heads_key or "state_size" in d or "ssm_state_size" in d):
            inner = int(expand * hidden)
            head_dim = HEAD_DIM if inner % HEAD_DIM == 0 else 8
            up[heads_key], up[dim_key] = inner // head_dim, head_dim
            handled.update((heads_key, dim_key))
    if d.get("mamba_d_ssm"):
        up["mamba_d_ssm"] = int(expand * hidden)
        handled.add("mamba_d_ssm")
    for k in ("mamba_n_groups", "n_groups", "mamba_ngroups"):
        if is_int(d.get(k)) and d[k] > 1 and ("mamba" in k or "state_size" in d or "ssm_state_size" in d):
            up[k] = 2
            handled.add(k)
    for k in ("mamba_d_state", "state_size", "ssm_state_size"):
        if is_int(d.get(k)) and d[k] > 16:
            up[k] = 16
            handled.add(k)
    for k in ("mamba_chunk_size", "chunk_size"):
        if is_int(d.get(k)) and d[k] > 16 and (k.startswith("mamba") or "state_size" in d or "ssm_state_size" in d or "mamba_d_state" in d):
            up[k] = 16
            handled.add(k)
    for k in ("mamba_dt_rank", "time_step_rank"):
        if is_int(d.get(k)) and d[k] > 8:
            up[k] = 8
            handled.add(k)


def shrink_rope(d: dict, up: dict, config) -> None:
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
            elif key == "original_max_position_embeddings" and is_int(val) and val > MAX_POSITIONS:
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
