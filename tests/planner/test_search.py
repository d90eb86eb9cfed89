"""`plan --auto`: the fastest setup that fits, and a command `train` accepts as it is."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace

import pytest

from lora_tune.cli import build_parser, config_from_args
from lora_tune.config import TrainConfig
from lora_tune.engines.registry import check_compatibility
from lora_tune.planner.architecture import load_architecture
from lora_tune.planner.hardware import GPUS
from lora_tune.planner.memory import estimate
from lora_tune.planner.records import Setup
from lora_tune.planner.search import fewest_checkpointed
from lora_tune.planner.speed import checkpointing_cost

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
    # A host far too small is said in a unit that shows it, not "needs 0.0 GiB of 0.0 GiB".
    code, out, _ = run_cli([*"plan --base llama-8b --gpu-memory 1MB --cpu-memory 1MB".split()], capsys)
    assert code == 0 and "does NOT fit in 976.6 KiB per GPU" in out
    assert re.search(r"host memory does NOT fit: needs \d+\.\d GiB of 976\.6 KiB", out), out


def test_auto_command_carries_the_data_and_output_folder_it_was_given(capsys):
    argv = ["--base", "llama-8b", "--auto", "--data", "my data.jsonl", "b.jsonl", "--output-dir", "runs/x"]
    assert plan_json(capsys, *argv)["recommended"]["command"].endswith("--data 'my data.jsonl' b.jsonl --output-dir runs/x")
    assert "FILE" not in plan_json(capsys, "--base", "llama-8b", "--auto", "--data", "d.jsonl")["recommended"]["command"]


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


def test_auto_checkpointing_recomputes_the_fewest_layers_that_fit():
    """Between every layer checkpointed and none, the largest number of layers keeping their
    activations whose plan fits the budget; none checkpointed when all fits; all when nothing does."""
    arch = load_architecture("llama-8b")
    setup = Setup(precision="bf16", rank=16, micro_batch_size=4, max_seq_len=4096)
    total = {kept: estimate(arch, replace(setup, kept_layers=kept)).per_device["total_bytes"] for kept in (0, 1, 16, 17, 31, 32)}
    # The last layer keeps its activations for free: backward frees them before rebuilding a layer.
    assert total[1] < total[0] < total[16] < total[17] < total[31] < total[32]
    half = fewest_checkpointed(arch, setup, (total[16] + total[17]) // 2)
    assert (half.gradient_checkpointing, half.kept_layers) == (True, 16)
    off = fewest_checkpointed(arch, setup, estimate(arch, replace(setup, gradient_checkpointing=False)).per_device["total_bytes"])
    assert (off.gradient_checkpointing, off.kept_layers) == (False, 0)
    assert fewest_checkpointed(arch, setup, total[0]).kept_layers == 1
    assert fewest_checkpointed(arch, setup, total[1] - 1).kept_layers == 0
    assert fewest_checkpointed(arch, setup, total[32] - 1).kept_layers == 31  # all but one recomputed: less than none
    # Keeping half the layers' activations saves half the recompute: a sixth of a fully checkpointed step.
    assert checkpointing_cost(half, arch.layers) == pytest.approx(1 + 1 / 6)


def test_plan_shows_what_auto_checkpointing_chooses_and_train_takes_the_command(capsys):
    plan = ["plan", "--base", "llama-8b", "--precision", "bf16", "--gradient-checkpointing", "auto"]
    code, out, err = run_cli([*plan, "--max-seq-len", "4096", "--micro-batch-size", "4", "--gpu-memory", "a100-80"], capsys)
    assert code == 0, err
    assert re.search(r"checkpointing (\d+) of 32 layers \(auto; step time ~\d+% below every layer\)", out), out
    code, out, err = run_cli([*plan, "--memory-budget", "200", "--gpu-memory", "h200"], capsys)
    assert code == 0 and "checkpointing off" in out, err


@pytest.mark.parametrize(
    "gpu,micro_batch,completions,tokens",
    # 32 completions of 1,024 tokens don't fit a 4090 at once; on an H100 16 of 256 would, but 16 doesn't divide 24
    [("rtx4090", 16, 32, 512), ("h100", 12, 24, 128)],
)
def test_auto_for_grpo_keeps_each_step_s_completions_and_gives_a_command_train_takes(gpu, micro_batch, completions, tokens, capsys):
    """Online RL: --auto splits the step's completions (micro-batch x grad-accum, whole groups) into
    micro-batches that divide them, so the command trains the same completions per step; and it
    plans the rollout's tokens."""
    argv = ["--base", "llama-8b", "--gpu-memory", gpu, "--objective", "grpo", "--num-generations", "4"]
    argv += ["--micro-batch-size", str(micro_batch), "--grad-accum", "2", "--max-new-tokens", str(tokens), "--max-seq-len", str(tokens)]
    command = plan_json(capsys, *argv, "--auto")["recommended"]["command"]
    words = shlex.split(command.replace("FILE", "data.jsonl").replace("DIR", "out"))
    cfg = config_from_args(TrainConfig, build_parser().parse_args([*words[1:], "--reward", "r.py:f", "--num-generations", "4"]))
    check_compatibility(cfg)
    assert cfg.objective == "grpo" and cfg.max_new_tokens == tokens
    assert cfg.micro_batch_size * cfg.grad_accum == completions
    assert cfg.micro_batch_size < micro_batch if gpu == "rtx4090" else cfg.micro_batch_size == 8


def test_auto_splits_rows_across_gpus_only_when_nothing_else_fits(capsys):
    """--auto searches --sequence-parallel too: at 4k tokens the fastest setup keeps rows whole (the
    all-to-alls cost time); at 256k nothing fits 8 x 80 GB without splitting every row over them."""
    argv = ["plan", "--base", "llama-8b", "--auto", "--gpus", "8", "--gpu-memory", "80GB", "--max-seq-len"]
    code, out, _ = run_cli([*argv, "4096"], capsys)
    assert code == 0 and "--sequence-parallel" not in out
    code, out, _ = run_cli([*argv, "262144"], capsys)
    assert code == 0 and "each row split over 8 ranks (sequence parallel)" in out and "--sequence-parallel 8" in out
    assert "fits in 74.5 GiB per GPU" in out
