"""LoRA targets come from the model (and are refused against the model's own list), the adapter starts
from the same values whatever the order of initialisation, and it is written in peft's layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_tune.adapter import Inventory, add_lora, lora_layers, meta_model, resolve_targets, save_adapter, trainable_state_dict
from lora_tune.config import TrainConfig
from lora_tune.errors import UserError
from lora_tune.model_loading import load_base_model, load_config

from families import build_family


def options(**kw):
    return SimpleNamespace(**{"target_modules": None, "dropout": 0.0, "dora": False, **kw})


@pytest.fixture(scope="module")
def gpt2_and_mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-families")
    return {name: load_config(str(build_family(name, root / name))) for name in ("gpt2", "mixtral")}


def test_the_default_targets_are_every_block_linear_and_the_experts(tiny_model, gpt2_and_mixtral):
    llama = resolve_targets(meta_model(load_config(str(tiny_model))), options())
    assert set(llama.modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} and llama.parameters == ()
    mixtral = resolve_targets(meta_model(gpt2_and_mixtral["mixtral"]), options())
    assert set(mixtral.parameters) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} and "gate" not in mixtral.modules
    inventory = Inventory.of(meta_model(gpt2_and_mixtral["mixtral"]))
    assert inventory.routers == ("mlp.gate",)


def test_targets_outside_the_model_are_refused_with_its_own_list(gpt2_and_mixtral):
    with pytest.raises(UserError, match="q_proj is not a linear layer .* choose from: c_attn c_fc c_proj"):
        resolve_targets(meta_model(gpt2_and_mixtral["gpt2"]), options(target_modules=["q_proj"]))


def test_expert_tensors_refuse_dropout_and_dora(gpt2_and_mixtral):
    skeleton = meta_model(gpt2_and_mixtral["mixtral"])
    with pytest.raises(UserError, match="--dropout 0.05: LoRA on mlp.experts"):
        resolve_targets(skeleton, options(dropout=0.05))
    with pytest.raises(UserError, match="--dora: peft has no DoRA for fused expert/router tensors"):
        resolve_targets(skeleton, options(dora=True))


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
