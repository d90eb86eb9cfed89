"""The benchmark scripts run as shipped (tiny shapes on CPU): the GPU one must work the day a GPU is lent."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_tiny(script: str, workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    """A benchmark script on its tiny shape, in a fresh interpreter; it must succeed."""
    argv = [sys.executable, f"benchmarks/{script}", "--tiny", "--workdir", str(workdir), *extra]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc


def test_gpu_bench_runs_every_route_on_a_tiny_shape(tmp_path):
    env = {**os.environ, "GPU_BENCH_TINY": "1", "GPU_BENCH_OUT": str(tmp_path / "gpu_bench"), "GPU_BENCH_WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", "benchmarks/gpu_bench.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "gpu_bench.jsonl").read_text().splitlines()]
    assert [(r["precision"], r["seq"]) for r in runs] == [("bf16", 1024), ("4bit", 1024)]
    lora_tune_routes = {"lora-tune train (defaults)", "lora-tune train --gradient-checkpointing on"}
    compiled = {"lora-tune train --compile", "lora-tune train --compile --gradient-checkpointing on"}
    peers = {"HF Trainer + PEFT (padded)", "TRL SFTTrainer (packing, padding-free)"}
    for run in runs:  # bitsandbytes' 4-bit layers don't compile: those routes are left out there
        assert set(run["results"]) == lora_tune_routes | peers | (compiled if run["precision"] == "bf16" else set())
        for result in run["results"].values():
            assert result["tokens"] > 0 and result["train_seconds"] > 0 and result["losses"]
    table = (tmp_path / "gpu_bench.md").read_text()
    assert table.count("| lora-tune train (defaults) |") == 2 and "vs TRL SFTTrainer" in table


def test_dpo_vs_trl_runs_every_route_on_a_tiny_shape(tmp_path):
    proc = run_tiny("dpo_vs_trl.py", tmp_path)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "route" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [
        "lora-tune train --objective dpo",
        "TRL DPOTrainer (PEFT reference per step)",
        "TRL DPOTrainer (reference precomputed)",
    ]
    for row in rows:
        pairs_per_second = float(row.split(" | ")[2])
        assert pairs_per_second > 0
    ratios = [line for line in proc.stdout.splitlines() if line.startswith("vs TRL DPOTrainer")]
    assert len(ratios) == 2 and all("pairs/s " in line and "peak RSS " in line for line in ratios)


def test_grpo_vs_trl_runs_both_routes_on_a_tiny_shape(tmp_path):
    proc = run_tiny("grpo_vs_trl.py", tmp_path)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "route" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [
        "lora-tune train --objective grpo",
        "TRL GRPOTrainer (transformers generation)",
    ]
    for row in rows:
        wall, rewards = float(row.split(" | ")[1]), [float(v) for v in row.split(" | ")[4:6]]
        assert wall > 0 and all(0 <= r <= 1 for r in rewards)
    assert any(
        line.startswith("lora-tune train --objective grpo vs TRL GRPOTrainer") and "peak RSS" in line for line in proc.stdout.splitlines()
    )
    assert "TRL GRPOTrainer(use_vllm=True) can't run on this CPU" in proc.stdout  # said, with the reasons


def test_agent_vs_trl_runs_both_routes_on_the_calculator(tmp_path):
    proc = run_tiny("agent_vs_trl.py", tmp_path)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "route" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [
        "lora-tune train --objective grpo --tools",
        "TRL GRPOTrainer(tools=[...])",
    ]
    for row in rows:
        cells = row.removesuffix(" |").split(" | ")
        wall, rewards, calls, masked = float(cells[1]), [float(v) for v in cells[4:6]], float(cells[6]), float(cells[7].rstrip("%"))
        assert wall > 0 and all(0 <= r <= 2 for r in rewards) and calls >= 0 and 0 <= masked < 100
    assert any(
        line.startswith("lora-tune train --objective grpo --tools vs TRL") and "peak RSS" in line for line in proc.stdout.splitlines()
    )


def test_checkpointing_budget_runs_and_auto_keeps_half_the_layers(tmp_path):
    proc = run_tiny("checkpointing_budget.py", tmp_path)
    assert "gradient checkpointing (auto): 2 of 4 decoder layers recomputed" in proc.stdout
    assert "same losses on every route: True" in proc.stdout and "planned 12.5%" in proc.stdout
    peak_line = next(line for line in proc.stdout.splitlines() if line.startswith("auto's measured peak:"))
    assert peak_line.endswith(": True")  # the peak of live tensor bytes, under the budget less the CUDA context


def test_compile_check_reports_cold_and_warm_compiles_and_eager_equal_losses(tmp_path):
    # 3 steps (the script's default is 20): the tiny run shows the script's figures are made (its cost is
    # the cold compile of step 1's graphs); the bound on graphs over 20 steps of varying widths is
    # tests/training/test_compilation.py's.
    proc = run_tiny("compile_check.py", tmp_path, "--steps", "3")
    rows = {row.split(" | ")[0].removeprefix("| "): row.split(" | ") for row in proc.stdout.splitlines() if row.startswith("| ")}
    assert set(rows) == {"route", "eager", "compiled, cold cache", "compiled, warm cache"}
    cold, warm = rows["compiled, cold cache"], rows["compiled, warm cache"]
    hits_cold, misses_cold = (int(x) for x in cold[7].removesuffix(" |").split(" / "))
    hits_warm, misses_warm = (int(x) for x in warm[7].removesuffix(" |").split(" / "))
    assert misses_cold >= 1 and misses_warm == 0 and hits_warm >= 1  # the second run compiles nothing anew
    assert int(cold[5]) <= 3 and int(warm[5]) == int(cold[5])  # graphs over the steps: bounded, the same on both runs
    assert float(warm[6]) < float(cold[6])  # compile seconds: the cache makes the second start cheaper
    differences = [float(line.split("over 3 steps ")[1].split(";")[0]) for line in proc.stdout.splitlines() if "largest relative" in line]
    assert len(differences) == 2 and max(differences) <= 1e-4


def test_train_vs_peers_repeats_routes_round_robin_and_reports_medians(tmp_path):
    routes = ["lora-tune train (defaults)", "HF Trainer + PEFT (padded)"]
    argv = [sys.executable, "benchmarks/train_vs_peers.py", "--tiny", "--workdir", str(tmp_path), "--cases", "equal-length"]
    argv += ["--seq", "1024", "--max-steps", "3", "--repeats", "3", "--json", str(tmp_path / "runs.jsonl"), "--routes", *routes]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    (summary,) = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    for name in routes:
        result = summary["results"][name]
        repeats = result["repeats"]
        assert len(repeats) == 3 and result["losses"] == repeats[0]["losses"]
        if name.startswith("lora-tune"):  # seeded and deterministic: every repeat trains the same numbers
            assert all(r["losses"] == repeats[0]["losses"] for r in repeats)
        for key in ("train_seconds", "median_step", "peak", "wall"):
            assert result[key] == sorted(r[key] for r in repeats)[1]  # the median of three
    each = [line for line in proc.stdout.splitlines() if line.startswith("  each repeat:")]
    assert len(each) == 1 and each[0].count("x") == 9  # training, per step and peak RSS ratios, three each


def test_long_context_gpu_script_runs_both_routes_on_a_tiny_shape(tmp_path):
    env = {**os.environ, "LONG_CONTEXT_TINY": "1", "LONG_CONTEXT_OUT": str(tmp_path / "lc"), "LONG_CONTEXT_WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", "benchmarks/long_context_gpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "lc.jsonl").read_text().splitlines()]
    assert [(r["precision"], r["seq"]) for r in runs] == [("4bit", 1024)]
    assert set(runs[0]["results"]) == {
        "lora-tune train --gradient-checkpointing on --tiled-mlp off",
        "lora-tune train --gradient-checkpointing on --tiled-mlp on",
    }
    for result in runs[0]["results"].values():
        assert result["tokens"] > 0 and result["losses"]


def test_vlm_vs_trl_trains_both_routes_on_a_tiny_image_text_model(tmp_path):
    argv = [sys.executable, "benchmarks/vlm_vs_trl.py", "--tiny", "--workdir", str(tmp_path), "--json", str(tmp_path / "vlm.json")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "route" not in line]
    assert [row[0].removeprefix("| ") for row in rows] == ["lora-tune train", "TRL SFTTrainer"]
    assert rows[0][7] == rows[1][7] != "0"  # the same LoRA parameters on both routes
    for row in rows:
        wall, tokens_per_second, peak = float(row[1]), float(row[4].replace(",", "")), float(row[6].replace(",", ""))
        assert wall > 0 and tokens_per_second > 0 and peak > 0 and math.isfinite(float(row[8].removesuffix(" |")))
    results = json.loads((tmp_path / "vlm.json").read_text())["results"]
    for result in results.values():  # both trained: every step's loss finite, the same steps and tokens
        assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"])
    assert results["lora-tune train"]["tokens"] == results["TRL SFTTrainer"]["tokens"] > 0
    ratio = next(line for line in proc.stdout.splitlines() if line.startswith("lora-tune vs TRL SFTTrainer:"))
    assert "x (whole process)" in ratio and "x (training)" in ratio and "peak RSS" in ratio


def test_peft_methods_runs_each_method_against_hf_trainer_on_a_tiny_shape(tmp_path):
    proc = run_tiny("peft_methods.py", tmp_path)
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "route" not in line]
    assert [(r[0].removeprefix("| "), r[1]) for r in rows] == [
        (method, route) for method in ("lora", "corda", "oft") for route in ("lora-tune", "HF Trainer + PEFT")
    ]
    for ours, theirs in zip(rows[::2], rows[1::2]):
        assert ours[2] == theirs[2] and int(ours[2].replace(",", "")) > 0  # the same peft config: the same trainable parameters
        assert all(math.isfinite(float(r[5])) and float(r[6].removesuffix(" |")) > 0 for r in (ours, theirs))


def test_ddp_vs_sharded_times_the_three_backends_on_two_ranks(tmp_path):
    proc = run_tiny("ddp_vs_sharded.py", tmp_path)
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ") and "route" not in line]
    assert [row[0].removeprefix("| ") for row in rows] == ["DDP", "ZeRO-1", "FSDP2"]
    for row in rows:  # step time, tokens/s, each rank's peak
        assert all(float(value.replace(",", "")) > 0 for value in row[1:5]) and row[5].endswith("x |")
    results = json.loads((tmp_path / "results.json").read_text())
    # The same rows and the same math on every backend: the first step's loss (fp32, before any update) agrees.
    first = [result["losses"][0] for result in results.values()]
    assert max(first) - min(first) <= 1e-5 * max(first) and all(len(result["losses"]) == 3 for result in results.values())
