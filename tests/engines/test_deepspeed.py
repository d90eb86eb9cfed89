"""DeepSpeed's declarations: its config from ours (and the user's file), and how ZeRO lays out states."""

from __future__ import annotations

import json

import pytest

from lora_tune.config import TrainConfig
from lora_tune.engines.deepspeed import deepspeed_config, place
from lora_tune.engines.registry import check_compatibility
from lora_tune.engines.spec import ModelStates

from helpers import ROOT

STATES = ModelStates(weights=8000, layer_weights=1000, trainable=400, gradients=400, optimizer=800, trainable_params=100)


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json"])
def test_shipped_deepspeed_configs_are_taken_with_our_batch_numbers(name):
    path = ROOT / "configs" / "deepspeed" / name
    stage = json.loads(path.read_text())["zero_optimization"]["stage"]
    cfg = TrainConfig(
        base="b", data="d", output_dir="o", precision="bf16", zero=stage, zero_config=str(path), micro_batch_size=3, grad_accum=5
    )
    check_compatibility(cfg)
    ds = deepspeed_config(cfg)
    assert (
        ds["zero_optimization"]["stage"] == stage and ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    )
    assert ds["zero_optimization"].get("reduce_bucket_size") == 500000000


@pytest.mark.parametrize(
    "stage,expected",
    [
        (1, dict(weights=8000, trainable=400, gradients=400, optimizer=200)),
        (2, dict(weights=8000, trainable=400, gradients=100, optimizer=200)),
        (3, dict(weights=2000 + 1000, trainable=100, gradients=100, optimizer=200)),  # own quarter + the gathered layer
    ],
)
def test_each_zero_stage_splits_what_it_shards(stage, expected):
    placed = place(STATES, stage, "none", 4)
    assert {k: getattr(placed.device, k) for k in expected} == expected
    assert placed.host_optimizer == placed.host_weights == 0


def test_cpu_offload_moves_cpu_adams_fp32_states_and_under_zero3_the_base():
    zero2 = place(STATES, 2, "cpu", 4)
    assert zero2.device.optimizer == 0 and zero2.host_optimizer == 12 * 100 // 4 and zero2.host_weights == 0
    zero3 = place(STATES, 3, "cpu", 4)
    assert zero3.device.weights == 2 * 1000  # the gathered layer and the prefetched next
    assert zero3.host_weights == 2000 + 1000 - 2000
