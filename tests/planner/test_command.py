"""`lora-tune plan` as a command: a training config plans as it is, bad input is one line, the
README's tables and the GPU benchmark script are what the planner computes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import lora_tune
from lora_tune.errors import UserError

from helpers import ROOT, run_cli, single_error_line


def test_plan_accepts_a_training_config(capsys):
    code, out, err = run_cli(["plan", "--config", ROOT / "configs" / "llama-70b-qlora.yaml", "--gpu-memory", "a100-80"], capsys)
    assert code == 0, err
    assert "setup: 4bit, rank 16" in out and "fits in 79.2 GiB" in out


def test_a_training_config_s_nproc_is_the_plan_s_gpu_count(capsys):
    """`plan` of a config with nproc: 4 and ZeRO-3 planned one GPU holding the whole model (--gpus
    defaulted to 1 and won over --nproc)."""
    plan = "plan --base llama-70b --precision bf16 --zero 3 --gpu-memory h100-80 --json".split()
    per_device = {}
    for extra in ([], ["--nproc", "4"], ["--gpus", "4"]):
        code, out, err = run_cli([*plan, *extra], capsys)
        assert code == 0, err
        per_device[" ".join(extra)] = json.loads(out)["per_device"]["weights_bytes"]
    assert per_device == {"": 142_818_689_024, "--nproc 4": 36_988_129_280, "--gpus 4": 36_988_129_280}  # ZeRO-3 over 4 GPUs


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--base", "llama-7b"], "did you mean"),
        (["--base", "llama-8b", "--gpu-memory", "huge"], "--gpu-memory"),
        (["--base", "llama-8b", "--precision", "fp16", "--backend", "fsdp"], "fp16 with --backend fsdp"),
        (["--base", "llama-8b", "--offload", "cpu"], "--offload needs a sharding backend"),
        (["--base", "llama-8b", "--gpus", "0"], "--gpus"),
        (["--base", "/no/such/model"], "does not exist"),
        (["--base", "llama-8b", "--gpu-memory", "24"], "--gpu-memory: '24' is a bare number, neither a size with its unit nor a GPU"),
        (["--base", "llama-8b", "--gpu-memory", "4080"], "--gpu-memory: '4080' is a bare number"),
        (["--base", "llama-8b", "--gpu-memory", "a100"], "--gpu-memory: 'a100' comes in more than one size; write a100-40 or a100-80"),
        (["--base", "llama-8b", "--cpu-memory", "512"], "--cpu-memory: '512' has no unit; write e.g. 512GB or 512GiB"),
    ],
)
def test_plan_bad_input(argv, expected, capsys):
    code, _, err = run_cli(["plan", *argv], capsys)
    assert code == 2 and expected in single_error_line(err)


@pytest.mark.parametrize(
    "typed,name", [("4090", "rtx4090"), ("RTX 4090", "rtx4090"), ("h100", "h100-80"), ("A100-80GB", "a100-80"), ("a10", "a10g")]
)
def test_gpu_names_as_people_shorten_them_are_recognised(typed, name):
    assert lora_tune.plan(base="llama-8b", gpu_memory=typed).to_json() == lora_tune.plan(base="llama-8b", gpu_memory=name).to_json()


def test_a_bare_number_in_a_yaml_config_or_the_api_is_refused_with_the_hint(tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    config.write_text("base: llama-8b\ngpu_memory: 24\n")
    code, _, err = run_cli(["plan", "--config", config], capsys)
    assert code == 2 and "--gpu-memory: '24' is a bare number" in single_error_line(err)
    with pytest.raises(UserError, match="--cpu-memory: '512' has no unit"):
        lora_tune.plan(base="llama-8b", cpu_memory=512)


def test_gpu_benchmark_script_runs_on_cpu_with_the_tiny_model():
    proc = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "plan_vs_measured.py", "--tiny"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("plan total") == 4


def test_the_plan_page_s_tables_are_what_plan_computes():
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "plan_tables.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = (ROOT / "docs" / "memory.md").read_text()
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "GiB" in line]
    assert len(rows) == 11
    for line in rows:
        assert line in page, line
