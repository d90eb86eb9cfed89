"""Tiny configs of a family keep its structure: the kinds of layers it mixes, its MoE and MLA shapes."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from lora_tune.tiny_configs import shrink_config


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mixtral", "phi3", "gpt2"])
def test_a_shrunk_config_builds_a_small_model_of_the_same_class(model_type):
    config = AutoConfig.for_model(model_type)
    tiny = shrink_config(config)
    assert type(tiny) is type(config)
    model = AutoModelForCausalLM.from_config(tiny)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000


def test_the_layer_pattern_keeps_one_of_each_kind():
    config = AutoConfig.for_model("qwen3_next")
    tiny = shrink_config(config)
    assert set(tiny.layer_types) == set(config.layer_types) and tiny.num_hidden_layers == len(tiny.layer_types) <= 4


def test_token_ids_stay_inside_the_small_vocabulary():
    tiny = shrink_config(AutoConfig.for_model("phi3"))
    assert tiny.vocab_size == 512 and tiny.pad_token_id < 512 and tiny.bos_token_id < 512 and tiny.eos_token_id < 512
