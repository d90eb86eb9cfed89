"""Long context in the plan, against measurements: `benchmarks/long_context.py` measures one
training step's peak tensor bytes per rank over one packed row (one process, and 2 gloo ranks with
--sequence-parallel 2, each with and without --tiled-mlp); `plan --max-context` inverts the plan."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lora_tune.models.tiny.model import build_tiny_llama
from lora_tune.planner.architecture import load_architecture
from lora_tune.planner.memory import estimate
from lora_tune.planner.records import Setup
from lora_tune.planner.search import CONTEXT_STEP, longest_context

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 4096
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_context  # noqa: E402 - the benchmark's own shape and configurations


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-context")
    base = build_tiny_llama(root / "base", **long_context.SHAPE)
    out = root / "figures.json"
    argv = [sys.executable, "benchmarks/long_context.py", "--tokens", str(TOKENS), "--base", str(base), "--json", str(out), "--suite"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base, {key.rsplit(", ", 1)[0]: r for key, r in json.loads(out.read_text())["results"].items()}


def test_sequence_parallel_halves_the_peak_and_tiles_lower_it_further(measured):
    _, results = measured
    one = results["one process"]["measured_bytes"]
    sp = results["--sequence-parallel 2"]["measured_bytes"]
    assert sp <= 0.55 * one  # each rank holds half the row, and no [tokens x tokens] mask
    assert results["--sequence-parallel 2 --tiled-mlp"]["measured_bytes"] < 0.9 * sp
    print(json.dumps({k: round(v["measured_bytes"] / 2**20, 1) for k, v in results.items()}))


def test_the_plan_is_the_measured_peak(measured):
    """Within 10% where nothing is tiled; tiled, the plan is conservative (up to a third above)."""
    _, results = measured
    for name, r in results.items():
        planned, got = r["planned_bytes"], r["measured_bytes"]
        if "tiled" in name:
            assert got <= planned <= 1.35 * got, (name, planned, got)
        else:
            assert planned == pytest.approx(got, rel=0.10), (name, planned, got)


@pytest.mark.parametrize("sp", [1, 2])
def test_max_context_inverts_the_measured_peak(measured, sp):
    """Given the memory the measured step took (plus the model states the plan counts), the longest
    --max-seq-len the plan finds is the measured row's length, within 10%."""
    base, results = measured
    arch = load_architecture(str(base))
    name = "one process" if sp == 1 else "--sequence-parallel 2"
    attention = "sdpa_packed" if sp == 1 else "ulysses_sdpa_packed"
    setup = Setup(precision="fp32", rank=8, optim="adamw", backend="single" if sp == 1 else "fsdp", gpus=sp, sequence_parallel=sp,
                  attention=attention)  # fmt: skip
    at_measured = replace(setup, max_seq_len=TOKENS, gradient_checkpointing=True)
    planned = estimate(arch, at_measured).per_device
    budget = planned["total_bytes"] - planned["activations_bytes"] - planned["logits_bytes"] + results[name]["measured_bytes"]
    longest = longest_context(arch, setup, budget, None, tiled=False)
    assert longest is not None and longest.max_seq_len % (CONTEXT_STEP * sp) == 0
    assert longest.max_seq_len == pytest.approx(TOKENS, rel=0.10)


def test_plan_max_context_answers_for_llama_8b_qlora(capsys):
    """The README's figures: Llama-3.1-8B, 4-bit, LoRA r16, on one 80 GB GPU and on eight with the
    row split over all of them (FSDP2)."""
    one = ["plan", "--base", "llama-8b", "--precision", "4bit", "--rank", "16", "--gpu-memory", "80GB", "--max-context"]
    code, out, _ = run_cli(one, capsys)
    assert code == 0 and out.startswith("longest --max-seq-len that fits: 183,552 tokens")
    code, out, _ = run_cli([*one, "--activation-offload"], capsys)
    assert code == 0 and out.startswith("longest --max-seq-len that fits: 585,984 tokens")
    code, out, _ = run_cli([*one, "--gpus", "8", "--backend", "fsdp", "--auto"], capsys)
    assert code == 0 and out.startswith("longest --max-seq-len that fits: 1,466,368 tokens")
    assert "each row split over 8 ranks (sequence parallel)" in out and "--sequence-parallel 8 --tiled-mlp on" in out
