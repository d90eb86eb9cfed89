"""Tiny configs of a family keep its structure: the kinds of layers it mixes, its MoE, MLA and
linear-attention shapes, an image-text wrapper's towers, blocks shared across layers."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from lora_tune.models.tiny.configs import shrink_config


def shrink(model_type: str):
    return shrink_config(CONFIG_MAPPING[model_type]())


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mixtral", "phi3", "gpt2"])
def test_a_shrunk_config_builds_a_small_model_of_the_same_class(model_type):
    config = AutoConfig.for_model(model_type)
    tiny = shrink_config(config)
    assert type(tiny) is type(config)
    model = AutoModelForCausalLM.from_config(tiny)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000


def test_token_ids_stay_inside_the_small_vocabulary():
    tiny = shrink_config(AutoConfig.for_model("phi3"))
    assert tiny.vocab_size == 512 and (tiny.pad_token_id, tiny.bos_token_id, tiny.eos_token_id) == (0, 1, 2)


def test_hybrid_linear_attention_keeps_both_layer_kinds():
    c = shrink("qwen3_next")
    assert c.num_hidden_layers == len(c.layer_types) <= 4 and set(c.layer_types) == {"linear_attention", "full_attention"}
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.num_experts, c.num_experts_per_tok) == (64, 4, 16, 4, 2)
    assert c.linear_num_value_heads == 2 * c.linear_num_key_heads  # the value/key head ratio of the release (32/16)


def test_mla_moe_keeps_dense_first_layers_shared_experts_and_ranks():
    c = shrink("deepseek_v3")
    assert c.num_hidden_layers == 4 and c.first_k_dense_replace == 2  # two dense, two MoE layers
    assert c.n_shared_experts == 1 and c.n_routed_experts == 4 and c.num_experts_per_tok == 2
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (32, 32, 8, 8, 16)
    assert c.qk_head_dim == 16


def test_image_text_config_shrinks_text_and_vision_and_reserves_special_tokens():
    c = shrink("gemma3")
    assert c.text_config.hidden_size == 64 and c.text_config.num_hidden_layers <= 4
    assert set(c.text_config.layer_types) == {"sliding_attention", "full_attention"}
    assert c.vision_config.num_hidden_layers == 2 and c.vision_config.hidden_size == 64
    assert c.text_config.vocab_size >= 512 and c.image_token_id >= 512  # the 512-token tokenizer never produces it


def test_llama4_keeps_chunked_full_and_no_rope_layers():
    c = shrink("llama4_text")
    assert set(c.layer_types) == {"chunked_attention", "full_attention"} and 0 in c.no_rope_layers and 1 in c.no_rope_layers
    assert c.num_local_experts == 4 and c.num_experts_per_tok == 1


def test_shared_blocks_get_two_instances():
    c = shrink("zamba")  # the shared transformer is tied across hybrid layers: two of them must exist
    assert c.layers_block_type.count("hybrid") == 2
