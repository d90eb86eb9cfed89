"""`--gradient-checkpointing auto` with a budget that lets half the layers keep their activations,
side by side in one run with every layer checkpointed and none: the measured step time against the
plan's prediction, and the measured peak against the budget and the plan.

Model: train_vs_peers.py's Llama-shaped `cpu` model (4 layers, 32k vocabulary), fp32, LoRA r16 on
every linear layer; equal-length samples (every micro-batch the same 4 x 1,024 tokens, so step
times compare); 6 steps, the first left out (warm-up). Each route is a fresh `lora-tune train`, run
twice: once timed, once under `tensor_peak.py` for its peak of live tensor bytes (on a CPU the
counterpart of CUDA's `max_memory_allocated`; the profiler slows steps, hence the separate run). The
plan's figures count a CUDA context (`CUDA_CONTEXT`) that a CPU run does not have: the measured peak
is compared with the plan and the budget less that term.

    python benchmarks/checkpointing_budget.py [--steps 6] [--workdir DIR] [--tiny]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from commands import bench_options, run_python, train_argv
from train_vs_peers import build_model, long_tail_rows

# A script run as `python SCRIPT ARGS...` would run it, from `python -c` (commands.run_python).
AS_MAIN = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def train(argv: list[str], preloaded: bool = False) -> subprocess.CompletedProcess:
    """`argv` ([python, script or -m module, ...]) to its end, output captured; `preloaded` (--tiny):
    forked from the server that has imported the libraries (commands.run_python)."""
    if preloaded:
        proc = run_python(AS_MAIN, argv[1:], preloaded=True)
    else:
        proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"route failed:\n{proc.stderr[-3000:]}")
    return proc


def run(base: Path, data: Path, out: Path, seq: int, steps: int, extra: list[str], timed: bool = True) -> dict:
    """A route's figures: its tensor peak from a run under the tracker, and its step times and peak
    RSS from a second, untracked run. `timed` False (--tiny, the test suite, which checks that the
    figures are made, not how fast): the tracked run's own figures, one run per route."""
    options = dict(precision="fp32", rank=16, micro_batch_size=4, max_seq_len=seq, max_steps=steps, optim="adamw")
    argv = train_argv(base, data, out, "--no-data-cache", *extra, **options)
    measured = out.with_name(out.name + "-tensor-peak")  # its own output folder: a run never reuses another's
    peak_file = measured.with_suffix(".json")
    tensor_peak = [sys.executable, str(Path(__file__).with_name("tensor_peak.py")), str(peak_file)]
    t = time.perf_counter()
    tracked = [*tensor_peak, *train_argv(base, data, measured, "--no-data-cache", *extra, **options)[1:]]  # argv[0] is python
    proc = train(tracked, preloaded=not timed)
    if timed:
        t = time.perf_counter()
        proc = train(argv)
    rows = [json.loads(line) for line in ((out if timed else measured) / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "loss" in r]
    chosen = next((line for line in proc.stderr.splitlines() if line.startswith("gradient checkpointing (auto)")), "")
    return {
        "step_seconds": statistics.median(r["step_seconds"] for r in steps_[1:]),
        "rss": max(r["peak_memory_bytes"] for r in steps_),
        "tensors": json.loads(peak_file.read_text())["peak_bytes"],
        "losses": [r["loss"] for r in steps_],
        "wall": time.perf_counter() - t,
        "log": chosen,
    }


def main() -> None:
    args, work = bench_options(6, "a 4-layer tiny model and short rows", "checkpointing-budget-")
    import torch

    from lora_tune.config import TrainConfig
    from lora_tune.planner.architecture import load_architecture
    from lora_tune.planner.memory import CUDA_CONTEXT, estimate, setup_from
    from lora_tune.planner.speed import checkpointing_cost
    from lora_tune.preflight import pass_tokens

    seq = 1024
    rows = long_tail_rows(16 if args.tiny else 24, seed=0, equal_length=True)
    data = work / "equal.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shape = "tiny4" if args.tiny else "cpu"
    base = build_model(work / f"model-{shape}", shape, [" ".join(r.values()) for r in rows])
    arch = load_architecture(str(base))
    cfg = TrainConfig(base=str(base), data=str(data), output_dir="o", precision="fp32", rank=16, micro_batch_size=4, max_seq_len=seq)
    # The run's own plan: on a CPU a micro-batch trains in passes of whole rows (lora_tune.data.batching.passes).
    setup = replace(setup_from(cfg), pass_tokens=pass_tokens(cfg, torch.device("cpu")))
    half = arch.layers // 2
    totals = {k: estimate(arch, replace(setup, kept_layers=k)).per_device["total_bytes"] for k in (half, half + 1)}
    budget = (totals[half] + totals[half + 1]) / 2 / 2**30  # room for half the layers' activations, not one more
    routes = {
        "every layer (on)": ["--gradient-checkpointing", "on"],
        f"auto, --memory-budget {budget:.3f} GiB": ["--gradient-checkpointing", "auto", "--memory-budget", f"{budget:.6f}"],
        "none (off)": ["--gradient-checkpointing", "off"],
    }
    results = {
        name: run(base, data, work / str(i), seq, args.steps, extra, not args.tiny) for i, (name, extra) in enumerate(routes.items())
    }
    print(
        f"Llama-shaped ({shape}) fp32 model, {arch.layers} layers, micro-batch 4 x {seq} tokens of equal-length samples, {args.steps} steps"
    )
    print("| checkpointing | median step s | peak tensors GiB (measured) | plan GiB, less the CUDA context | peak RSS MiB | plan GiB |")
    print("|---|---|---|---|---|---|")
    planned = {
        "every layer (on)": replace(setup, kept_layers=0),
        "none (off)": replace(setup, gradient_checkpointing=False),
    }
    planned[next(n for n in routes if n.startswith("auto"))] = replace(setup, kept_layers=half)
    for name, r in results.items():
        plan = estimate(arch, planned[name]).per_device["total_bytes"]
        tensors, planned_tensors = r["tensors"] / 2**30, (plan - CUDA_CONTEXT) / 2**30
        print(
            f"| {name} | {r['step_seconds']:.3f} | {tensors:.3f} | {planned_tensors:.3f} | {r['rss'] / 2**20:,.0f} | {plan / 2**30:.3f} |"
        )
    auto_name = next(n for n in routes if n.startswith("auto"))
    on, auto = results["every layer (on)"], results[auto_name]
    measured = 1 - auto["step_seconds"] / on["step_seconds"]
    predicted = 1 - checkpointing_cost(planned[auto_name], arch.layers) / checkpointing_cost(planned["every layer (on)"], arch.layers)
    print()
    print(auto["log"])
    room = budget - CUDA_CONTEXT / 2**30
    print(
        f"auto's measured peak: {auto['tensors'] / 2**30:.3f} GiB of tensors, under the budget {budget:.3f} GiB less the plan's "
        f"{CUDA_CONTEXT / 2**30:.3f} GiB CUDA context (not on a CPU) = {room:.3f} GiB: {auto['tensors'] / 2**30 <= room}"
    )
    print(f"step time saved vs every layer: measured {measured:.1%}, planned {predicted:.1%} (ratio {measured / predicted:.2f})")
    print(f"same losses on every route: {len({tuple(r['losses']) for r in results.values()}) == 1}")


if __name__ == "__main__":
    main()
