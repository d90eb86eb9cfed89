"""The architecture read off a meta skeleton: parameters and LoRA parameters exact for every family,
published sizes, and what stays bf16 under 8/4-bit."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from lora_tune.config import TrainConfig
from lora_tune.models.aliases import architecture
from lora_tune.models.targets import lora_config, resolve_targets
from lora_tune.planner.architecture import Architecture
from lora_tune.planner.memory import lora_tensors
from lora_tune.planner.records import Setup

from families import FAMILIES, family_configs
from helpers import run_cli


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_counts_equal_the_instantiated_model(family):
    """Parameters and LoRA parameters (rank 8, default targets) as the planner counts them from
    config.json alone, against the real model with peft's adapter injected."""
    config = family_configs(512)[family]
    arch = Architecture.from_config(config.to_dict())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert arch.total == sum(p.numel() for p in model.parameters())
    cfg = TrainConfig(base="x", data="x.jsonl", output_dir="o", rank=8)
    targets = resolve_targets(model, cfg)
    peft_model = get_peft_model(model, lora_config(cfg, targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert sum(lora_tensors(arch, Setup(rank=8))) == trainable


# Published sizes, from the models' real config.json (Pythia is not an alias: its config is here).
PYTHIA_6_9B = {
    "model_type": "gpt_neox",
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 50432,
    "max_position_embeddings": 2048,
    "rotary_pct": 0.25,
    "use_parallel_residual": True,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "base, params, lora",
    [
        ("mixtral-8x7b", 46_702_792_704, 223_346_688),  # experts stored: 8 x 3 x 4096 x 14336 per layer
        (PYTHIA_6_9B, 6_857_302_016, 33_554_432),
        ("phi3-mini", 3_821_079_552, 25_165_824),
        ("qwen2.5-7b", 7_615_616_512, 40_370_176),
    ],
)
def test_plan_matches_published_sizes(base, params, lora):
    arch = Architecture.from_config(architecture(base) if isinstance(base, str) else base)
    assert arch.total == params
    assert sum(lora_tensors(arch, Setup(rank=16))) == lora


def test_plan_of_a_moe_model_counts_all_experts_and_says_what_stays_bf16(capsys):
    code, out, _ = run_cli(["plan", "--base", "mixtral-8x7b", "--precision", "4bit", "--gpu-memory", "h100-80"], capsys)
    assert code == 0
    weights = float(next(line for line in out.splitlines() if line.strip().startswith("weights")).split()[1])
    assert weights == pytest.approx(85.14, abs=0.01)  # 45.1B expert parameters in bf16: bitsandbytes quantizes linears only
    assert "does NOT fit" in out and "fused MoE expert tensors (45.10B of 46.70B parameters) stay in bf16" in out
    code, out, _ = run_cli([*"plan --base mixtral-8x7b --auto --gpus 2 --gpu-memory h100-80".split()], capsys)
    # Layer-by-layer loading converts Mixtral's per-expert tensors as transformers does: FSDP2 is a candidate.
    assert code == 0 and "--backend fsdp" in out
    code, _, err = run_cli(["plan", "--base", "mixtral-8x7b", "--backend", "fsdp", "--gpus", "2"], capsys)
    assert code == 0, err
