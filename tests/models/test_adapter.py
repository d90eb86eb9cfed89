"""The adapter on the base (lora_tune.models.adapter): the same initial values whatever the order of
initialisation, written in peft's layout, and nothing half-written when a write fails."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_tune.config import TrainConfig
from lora_tune.models.adapter import add_lora, save_adapter, trainable_state_dict
from lora_tune.models.loading import load_base_model
from lora_tune.models.targets import (
    lora_layers,
)


def test_initial_lora_values_are_seeded_by_layer_name_not_by_order(tiny_model):
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4, seed=11)
    first = trainable_state_dict(add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, "b"))
    torch.manual_seed(999)  # whatever happened before must not matter
    again = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, "b")
    second = trainable_state_dict(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert all(layer.lora_B["default"].weight.abs().sum() == 0 for _, layer in lora_layers(again))  # B starts at zero
    other = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4, seed=12)
    third = trainable_state_dict(add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), other, "b"))
    assert not torch.equal(
        first["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
        third["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
    )


def test_the_saved_adapter_loads_with_peft_and_no_temp_file_is_left(tiny_model, tmp_path):
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4)
    model = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, str(tiny_model))
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B["default"].weight.fill_(0.01)
    save_adapter(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path)
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_failed_adapter_write_leaves_no_temporary_file(tiny_model, tmp_path, monkeypatch):
    cfg = TrainConfig(base=str(tiny_model), data="d", output_dir="o", precision="fp32", rank=4)
    model = add_lora(load_base_model(str(tiny_model), "fp32", torch.device("cpu")), cfg, str(tiny_model))

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(model.peft_config["default"]), "save_pretrained", full_disk)  # after the weights were written
    with pytest.raises(OSError, match="No space left"):
        save_adapter(model, tmp_path)
    assert list(tmp_path.iterdir()) == []
