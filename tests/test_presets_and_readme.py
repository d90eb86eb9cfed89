"""Every YAML preset validates; the README quick start runs as written."""

from __future__ import annotations

import os
import re
import shlex

import pytest
import yaml

import lora_tune
from lora_tune.cli import build_parser, config_from_args
from lora_tune.config import TrainConfig
from lora_tune.planner.hardware import gpu_memory_bytes

from helpers import ROOT, run_cli_subprocess

PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_presets():
    assert len(PRESETS) >= 4


HARDWARE = re.compile(r"^# Hardware: (?:(\d+) nodes x )?(\d+) x ([\w.-]+) \(plan: fits with >= ([\d.]+) GiB spare per GPU\)$")


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_validates_and_its_header_launch_command_parses(preset):
    header = preset.read_text().splitlines()[:3]
    assert header[0].startswith("# Launch: "), f"{preset.name} must start with its launch command"
    argv = shlex.split(header[0].removeprefix("# Launch: "))
    assert argv[:2] == ["lora-tune", "train"]
    # The header's paths are relative to the repository's root, where a user runs it from.
    argv = [str(ROOT / word) if (ROOT / word).is_file() else word for word in argv]
    cfg = config_from_args(TrainConfig, build_parser().parse_args(argv[1:]))
    assert cfg.base and cfg.output_dir
    assert set(yaml.safe_load(preset.read_text())) <= set(TrainConfig.model_fields)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_fits_the_hardware_its_header_names(preset):
    """The plan, for the preset's own hardware, fits with at least the spare the header states."""
    match = HARDWARE.match(preset.read_text().splitlines()[1])
    assert match, f"{preset.name}: line 2 must be '# Hardware: N x GPU (plan: fits with >= X GiB spare per GPU)'"
    nodes, gpus, gpu, margin = int(match.group(1) or 1), int(match.group(2)), match.group(3), float(match.group(4))
    plan = lora_tune.plan(str(preset), gpus=gpus, nodes=nodes, gpu_memory=gpu)
    spare = (gpu_memory_bytes(gpu) - plan.per_device["total_bytes"]) / 2**30
    assert plan.fits and spare >= margin, (preset.name, spare)
    config = yaml.safe_load(preset.read_text())
    assert (config.get("nproc") or 1) == gpus  # the launch command starts that many ranks


def quick_start_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M).group(1)
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_quick_start_is_two_lines_and_ci_runs_its_test_command():
    lines = quick_start_lines()
    assert len(lines) == 2
    assert "lora-tune train" in lines[0] and "pip install" in lines[0]
    assert lines[1] in (ROOT / ".ci" / "run").read_text()


def test_quick_start_training_runs_offline(tmp_path):
    """The first line's job (after its install step), with the output sent to a temp folder."""
    command = quick_start_lines()[0].split("&&", 1)[1]
    argv = shlex.split(command)
    assert argv[0] == "lora-tune"
    i = argv.index("--output-dir")
    argv[i + 1] = str(tmp_path / "demo")
    env = {**os.environ, "LORA_TUNE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = run_cli_subprocess(argv[1:], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "demo" / "adapter_model.safetensors").is_file()
    assert "tok/s" in proc.stderr and "peak" in proc.stderr


def test_what_lora_tune_never_does_is_backed_by_tests_that_exist():
    page = (ROOT / "docs" / "training.md").read_text()
    paragraph = page.split("**What lora-tune never does**")[1].split("\n## ")[0]
    named = set(re.findall(r"`(test_\w+)`", paragraph))
    assert len(named) >= 10, named
    defined = {m for f in (ROOT / "tests").rglob("test_*.py") for m in re.findall(r"^def (test_\w+)", f.read_text(), re.M)}
    assert named <= defined, named - defined
