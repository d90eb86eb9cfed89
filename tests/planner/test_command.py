"""`lora-tune plan` as a command: a training config plans as it is, bad input is one line, the
README's tables and the GPU benchmark script are what the planner computes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT, run_cli, single_error_line


def test_plan_accepts_a_training_config(capsys):
    code, out, err = run_cli(["plan", "--config", ROOT / "configs" / "llama-70b-qlora.yaml", "--gpu-memory", "a100-80"], capsys)
    assert code == 0, err
    assert "setup: 4bit, rank 16" in out and "fits in 79.2 GiB" in out


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--base", "llama-7b"], "did you mean"),
        (["--base", "llama-8b", "--gpu-memory", "huge"], "--gpu-memory"),
        (["--base", "llama-8b", "--precision", "fp16", "--backend", "fsdp"], "fp16 with --backend fsdp"),
        (["--base", "llama-8b", "--offload", "cpu"], "--offload needs a sharding backend"),
        (["--base", "llama-8b", "--gpus", "0"], "--gpus"),
        (["--base", "/no/such/model"], "does not exist"),
    ],
)
def test_plan_bad_input(argv, expected, capsys):
    code, _, err = run_cli(["plan", *argv], capsys)
    assert code == 2 and expected in single_error_line(err)


def test_gpu_benchmark_script_runs_on_cpu_with_the_tiny_model():
    proc = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "plan_vs_measured.py", "--tiny"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("plan total") == 4


def test_readme_plan_tables_are_what_plan_computes():
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "plan_tables.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "GiB" in line]
    assert len(rows) == 11
    for line in rows:
        assert line in readme, line
