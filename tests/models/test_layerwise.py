"""Layer-by-layer loading on one process: the reader returns each tensor as stored, and a skeleton
filled layer by layer (with a partition step that does nothing) is the model from_pretrained loads."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lora_tune.models import layerwise
from lora_tune.models.loading import load_config
from lora_tune.models.structure import auto_class, text_ids
from lora_tune.models.tiny.model import build_tiny_model


def test_the_reader_returns_every_tensor_as_stored(tiny_model):
    reader = layerwise.CheckpointReader(str(tiny_model))
    stored = load_file(str(tiny_model / "model.safetensors"))
    assert set(reader.entries) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(reader.get(name), tensor), name


def test_decoder_layers_are_found_by_the_models_own_declaration(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    layers = layerwise.decoder_layers(model)
    assert [name for name, _ in layers] == ["model.layers.0", "model.layers.1"]


def filled(base):
    """The fp32 skeleton of `base` filled layer by layer on the CPU, and the units in the order they were partitioned."""
    skeleton, reader = layerwise.build_skeleton(str(base), "fp32", trust_remote_code=False)
    partitioned = []
    layerwise.load_layer_by_layer(
        skeleton,
        reader,
        torch.device("cpu"),
        "fp32",
        init_adapter=lambda unit, name: None,
        partition=lambda layer: partitioned.append(layer),
        partition_root=lambda root: partitioned.append(root),
    )
    return skeleton, partitioned


def test_filled_layer_by_layer_equals_from_pretrained(tiny_model):
    skeleton, partitioned = filled(tiny_model)
    assert len(partitioned) == 3 and partitioned[-1] is skeleton  # each layer before the next is read, the root last
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(skeleton(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("model_type", ["mixtral", "gemma3"])
def test_a_converted_checkpoint_is_filled_as_from_pretrained_converts_it(model_type, tmp_path):
    """Mixtral stores one tensor per expert (fused into 3-D parameters on load); a Gemma 3 image-text
    checkpoint stores its language model as `language_model.model.*`: both are converted layer by
    layer with transformers' own conversion mapping (the language model's layers first, the vision
    tower with the rest)."""
    base = build_tiny_model(model_type, tmp_path / model_type)
    skeleton, partitioned = filled(base)
    reference = auto_class(load_config(str(base))).from_pretrained(base, dtype=torch.float32).eval()
    assert len(partitioned) == len(layerwise.decoder_layers(reference)) + 1 > 2
    want, got = reference.state_dict(), skeleton.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ids = text_ids(reference, (1, 16), seed=0)
    with torch.no_grad():
        assert torch.equal(skeleton.eval()(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_checkpoint_under_other_names_is_not_streamable(tiny_model, tmp_path):
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_model, renamed)
    weights = load_file(str(renamed / "model.safetensors"))
    weights = {k.replace("model.layers.", "model.blocks."): v for k, v in weights.items()}
    save_file(weights, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(layerwise.NotStreamable, match="the checkpoint has no tensor for model.layers.0.self_attn.q_proj.weight"):
        layerwise.build_skeleton(str(renamed), "fp32", trust_remote_code=False)
