"""FSDP2's declarations: everything sharded, two layers in flight, CPU offload of all states."""

from __future__ import annotations

from lora_tune.engines.fsdp import SPEC, place
from lora_tune.engines.spec import ModelStates

STATES = ModelStates(weights=8000, layer_weights=1000, trainable=400, gradients=400, optimizer=800, trainable_params=100)


def test_fsdp2_splits_every_state_and_gathers_two_layers():
    placed = place(STATES, 0, "none", 4)
    assert (placed.device.weights, placed.device.trainable, placed.device.gradients, placed.device.optimizer) == (
        2000 + 2000,
        100,
        100,
        200,
    )


def test_fsdp2_offload_keeps_only_the_layers_in_flight_on_the_device():
    placed = place(STATES, 0, "cpu", 4)
    assert (placed.device.weights, placed.device.trainable, placed.device.gradients, placed.device.optimizer) == (2000, 0, 0, 0)
    assert placed.host_optimizer == 100 + 100 + 200 and placed.host_weights == 2000


def test_fsdp2_refuses_fp16_and_nvme_and_streams_every_precision():
    assert "loss scaler" in SPEC.refusal("fp16", 0, "none") and "host memory only" in SPEC.refusal("bf16", 0, "nvme")
    assert SPEC.refusal("4bit", 0, "cpu") is None and all(SPEC.loads_layer_by_layer(p, 0) for p in ("bf16", "8bit", "4bit"))
