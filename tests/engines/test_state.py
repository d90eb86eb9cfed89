"""A rank's checkpoint part (lora_tune.engines.state): pickle-free, what goes in comes back."""

from __future__ import annotations

from enum import Enum

import pytest
import torch

from lora_tune.engines import state as state_files
from lora_tune.errors import UserError


def test_safe_state_keeps_tensors_numbers_and_structure_and_drops_objects(tmp_path):
    class Stage(Enum):
        TWO = 2

    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        "stage": Stage.TWO,
        "scaler": object(),
        "nan": float("inf"),
    }
    state_files.save_safe_state(tmp_path, "s", state)
    back = state_files.load_safe_state(tmp_path, "s")
    assert torch.equal(back["state"][0]["exp_avg"], torch.arange(4.0)) and back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["stage"] == 2 and back["scaler"] is None and back["nan"] == float("inf")


def test_a_missing_or_corrupt_safe_state_is_named(tmp_path):
    with pytest.raises(UserError, match="s.safetensors is unreadable or truncated"):
        state_files.load_safe_state(tmp_path, "s")
