"""The smallest config of the same family: for probing a model's behaviour on a tiny random instance of
its own class (does packing keep samples apart?), and for the family sweep.

Sizes are cut from the config's own attributes (whatever of these it has), the layer pattern is kept
(one layer of each kind it mixes: linear and full attention, sliding windows, dense first layers
before MoE ones), and sub-configs (`text_config`, `vision_config`) are cut the same way.
"""

from __future__ import annotations

# Upper bounds per attribute: a config keeps its own value when it is smaller.
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "sliding_window": 64,
    "first_k_dense_replace": 1,
    "image_size": 32,
    "patch_size": 8,
    "n_inner": 128,
    "n_embd": 64,
    "n_head": 4,
    "n_positions": 256,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")
SUB_CONFIGS = ("text_config", "vision_config")


def _layer_pattern(values: dict) -> list | None:
    """The shortest prefix of `layer_types` holding every kind of layer the model mixes."""
    types = values.get("layer_types")
    if not isinstance(types, list) or not types:
        return None
    kinds = set(types)
    for n in range(1, len(types) + 1):
        if set(types[:n]) == kinds:
            return types[:n]
    return types


def shrink_config(config):
    """A config of the same class with every size cut down (see SIZES) and 2 layers, or as few as keep
    each kind of layer; the original is left untouched."""
    values = config.to_dict()
    for key, bound in SIZES.items():
        if isinstance(values.get(key), int) and not isinstance(values[key], bool) and values[key] > bound:
            values[key] = bound
    if "qk_rope_head_dim" in values and "head_dim" in values:
        values["head_dim"] = values["qk_rope_head_dim"]  # MLA: the rotary part is what head_dim sizes
    vocab = values.get("vocab_size")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(vocab, int) and isinstance(values.get(key), int) and values[key] >= vocab:
            values[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    pattern = _layer_pattern(values)
    layers = max(2, len(pattern) if pattern else 2, values.get("first_k_dense_replace", 0) + 1)
    for key in LAYER_COUNTS:
        if isinstance(values.get(key), int):
            values[key] = min(values[key], layers)
    if pattern:
        values["layer_types"] = (pattern * layers)[:layers]
    for key in SUB_CONFIGS:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            values[key] = shrink_config(sub).to_dict()
    values.pop("transformers_version", None)
    return type(config).from_dict(values)
