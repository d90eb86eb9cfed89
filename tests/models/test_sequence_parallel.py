"""Sequence parallelism's model side (lora_tune.models.sequence_parallel) and tiled MLPs
(lora_tune.models.tiled_mlp); the runs across ranks are in tests/engines/test_sequence_parallel_runs.py."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Gemma2Config, LlamaConfig, LlamaForCausalLM, MistralConfig, MixtralConfig

from lora_tune.models import sequence_parallel, tiled_mlp


def test_what_sequence_parallelism_refuses():
    assert sequence_parallel.refusal(LlamaConfig(num_attention_heads=32, num_key_value_heads=8), 8) is None
    assert sequence_parallel.refusal(LlamaConfig(num_attention_heads=32, num_key_value_heads=2), 8) is None  # key/value heads repeated
    assert "32 attention heads, which 3 ranks can't split evenly" in sequence_parallel.refusal(LlamaConfig(num_attention_heads=32), 3)
    assert "sliding" in sequence_parallel.refusal(MistralConfig(sliding_window=4096), 2)
    assert sequence_parallel.refusal(MistralConfig(sliding_window=None), 2) is None
    assert "attn_logit_softcapping" in sequence_parallel.refusal(Gemma2Config(), 2)


def test_samples_start_where_positions_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert sequence_parallel.sample_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3]]


def test_generation_runs_the_inner_attention_and_switches_back():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    model.set_attn_implementation("ulysses_sdpa")
    with sequence_parallel.plain_attention(model):
        assert model.config._attn_implementation == "sdpa"
        out = model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5) and model.config._attn_implementation == "ulysses_sdpa"
    with pytest.raises(RuntimeError, match="runs on row shards only"):  # never silently another attention
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_tiled_mlp_keeps_names_and_computes_the_untiled_numbers():
    """The tiles share the MLP's own tables: the state dict and the adapter's keys are the untiled
    model's, peft's LoRA layers land in both, and loss and gradients are the untiled ones."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    plain = LlamaForCausalLM(config)
    tiled = copy.deepcopy(plain)
    assert tiled_mlp.tile_mlps(tiled, 3) == 2
    assert list(tiled.state_dict()) == list(plain.state_dict())
    lora = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    a = get_peft_model(plain, lora)
    torch.manual_seed(1)
    b = get_peft_model(tiled, copy.deepcopy(lora))
    assert list(a.state_dict()) == list(b.state_dict())
    assert isinstance(b.base_model.model.model.layers[0].mlp, tiled_mlp.TiledMLP)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    losses = []
    for model in (a, b):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    grads_b = dict(b.named_parameters())
    for name, p in a.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads_b[name].grad, rtol=1e-5, atol=1e-7)


def test_tiles_are_fixed_per_run_and_experts_are_not_tiled():
    assert tiled_mlp.tile_count(1024, 64) == 1 and tiled_mlp.tile_count(4096, 64) == 4 and tiled_mlp.tile_count(131072, 4096) == 32
    assert "mixture of experts" in tiled_mlp.refusal(MixtralConfig())
    assert tiled_mlp.refusal(LlamaConfig()) is None
