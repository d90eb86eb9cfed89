"""The sizes a tiny twin shrinks to, and the attribute names (after `attribute_map`) they apply to."""

from __future__ import annotations

TEXT_VOCAB = 512  # lora_tune.models.tiny.model.train_tiny_tokenizer(); multimodal special ids go above it


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
