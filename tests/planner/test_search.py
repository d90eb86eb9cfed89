"""`plan --auto`: the fastest setup that fits, and a command `train` accepts as it is."""

from __future__ import annotations

import json
import shlex

import pytest

from lora_tune.cli import build_parser, config_from_args
from lora_tune.config import TrainConfig
from lora_tune.engines import check_compatibility
from lora_tune.planner.hardware import GPUS

from helpers import run_cli


def plan_json(capsys, *args) -> dict:
    code, out, err = run_cli(["plan", *args, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def test_auto_recommends_a_fitting_setup_and_a_command(capsys):
    code, out, err = run_cli(["plan", "--base", "llama-8b", "--auto", "--gpu-memory", "rtx4090"], capsys)
    assert code == 0, err
    assert "fastest setup that fits" in out and "fits in 23.6 GiB" in out
    assert "lora-tune train --base llama-8b" in out
    result = plan_json(capsys, "--base", "llama-8b", "--auto", "--gpu-memory", "rtx4090")
    assert result["fits"] is True and result["per_device"]["total_bytes"] <= GPUS["rtx4090"]
    assert result["recommended"]["command"].startswith("lora-tune train")


def test_auto_says_when_nothing_fits(capsys):
    code, out, _ = run_cli([*"plan --base llama-70b --auto --gpu-memory 4GB --cpu-memory 8GB".split()], capsys)
    assert code == 0
    assert "nothing fits; the nearest option" in out and "does NOT fit" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--base", "llama-70b", "--gpu-memory", "t4"],
        ["--base", "llama-70b", "--gpu-memory", "a100-40", "--gpus", "8"],
        ["--base", "llama-8b", "--gpu-memory", "rtx4090"],
    ],
)
def test_auto_commands_are_exact_train_commands(argv, capsys):
    """What --auto prints must be accepted by `train` as it is (flags and compatibility matrix)."""
    command = plan_json(capsys, *argv, "--auto")["recommended"]["command"]
    words = shlex.split(command.replace("FILE", "data.jsonl").replace("DIR", "out"))
    assert words[:2] == ["lora-tune", "train"]
    cfg = config_from_args(TrainConfig, build_parser().parse_args(words[1:]))
    check_compatibility(cfg)
