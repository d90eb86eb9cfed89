"""A model's parts found by structure: the class its checkpoints load through (image-text wrappers
included), the decoder body where `base_model_prefix` names no attribute (Llama 4), and LoRA
targets kept inside the language model."""

from __future__ import annotations

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText

from lora_tune.models.structure import auto_class, body_path, decoder_body, meta_model, model_class
from lora_tune.models.targets import Inventory
from lora_tune.models.tiny.configs import shrink_config


def shrink(model_type: str):
    return shrink_config(CONFIG_MAPPING[model_type]())


def test_image_text_checkpoints_load_through_their_image_text_class():
    # Mistral 3 has no causal-LM class at all; Gemma 3 has one, but its checkpoints are saved from the wrapper.
    for model_type, cls in (("mistral3", "Mistral3ForConditionalGeneration"), ("gemma3", "Gemma3ForConditionalGeneration")):
        assert auto_class(shrink(model_type)) is AutoModelForImageTextToText and model_class(shrink(model_type)).__name__ == cls
    assert auto_class(shrink("llama4_text")) is AutoModelForCausalLM and model_class(shrink("llama4_text")).__name__ == "Llama4ForCausalLM"


def test_decoder_body_is_found_where_base_model_prefix_is_wrong():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shrink("llama4_text")).eval()
    assert not hasattr(model, model.base_model_prefix)  # "language_model": the chunked loss's old traceback
    ids = torch.randint(3, 500, (1, 8))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = model.get_output_embeddings()(decoder_body(model)(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_an_image_text_model_offers_lora_only_its_language_model():
    skeleton = meta_model(shrink("gemma3"))
    assert body_path(skeleton) == "model.language_model"
    inventory = Inventory.of(skeleton)
    # The SigLIP tower has q/k/v_proj, out_proj, fc1, fc2 too: none of them is offered.
    assert inventory.linears == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert {"q_proj", "out_proj", "fc1"} <= set(inventory.elsewhere) and inventory.body == "model.language_model"
