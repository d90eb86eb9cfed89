"""Disk <-> model names and tensors, one decoder layer at a time, exactly as transformers converts
them on load and back on save: per-expert MoE tensors fused (Mixtral) and an image-text wrapper's
renamed language model (Gemma 3)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING

from lora_tune.models.checkpoint_layout import CheckpointLayout
from lora_tune.models.structure import auto_class, meta_model
from lora_tune.models.tiny.configs import shrink_config


@pytest.mark.parametrize("model_type", ["mixtral", "gemma3"])
def test_each_layer_converts_both_ways_bit_for_bit(model_type, tmp_path):
    config = shrink_config(CONFIG_MAPPING[model_type]())
    torch.manual_seed(0)
    auto_class(config).from_config(config).save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    loaded = auto_class(config).from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    layout = CheckpointLayout(meta_model(config), disk)
    assert not layout.is_identity

    def layer(key):
        found = re.search(r"layers\.(\d+)\.", key)
        return found[1] if found else None

    for n in sorted({layer(k) for k in layout.groups}, key=str):
        keys = [k for k in layout.groups if layer(k) == n]
        part = {d: disk[d] for k in keys for d in layout.groups[k]}
        got = layout.disk_to_model(part)
        assert all(torch.equal(got[k], loaded[k]) for k in keys)  # what from_pretrained loads
        back = layout.model_to_disk({k: loaded[k] for k in keys})
        assert back.keys() == part.keys() and all(torch.equal(back[d], disk[d]) for d in part)  # what save_pretrained writes
    fused = layout.groups.get("model.layers.0.mlp.experts.gate_up_proj")
    if model_type == "mixtral":  # one fused tensor from every expert's w1 and w3
        assert fused == [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w3")]
    else:
        assert layout.groups["model.language_model.layers.0.self_attn.q_proj.weight"] == [
            "language_model.model.layers.0.self_attn.q_proj.weight"
        ]
