"""DDP vs ZeRO-1 vs FSDP2 on 2 ranks: step time and peak memory per rank, for LoRA on a base that
fits one device (the case DDP is the default for).

Each route runs `lora-tune train --nproc 2` on the same Llama-shaped model (random weights: hidden
1024, intermediate 2816, 16 layers, vocab 32000, ~0.25 B parameters; `--tiny`: 2 layers of 64) over
the same packed rows, for --steps optimizer steps; --repeats N runs the routes round-robin N times
(so a machine's load falls on each alike). Step time is the median of rank 0's `step_seconds` after
the first step (which builds what the layers keep), over the repeats; tokens/s the job's tokens over
it. Peak memory is what each rank says after its first step (the step's shapes repeat, so the run's
peak), the largest over the repeats: on a GPU its device peak, on a CPU its peak RSS (VmHWM), host
and "device" alike.

    python benchmarks/ddp_vs_sharded.py [--steps 8] [--repeats 1] [--precision bf16|fp32] [--workdir DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
from pathlib import Path

from commands import bench_options, train_argv  # benchmarks/ is on sys.path: these run as scripts
from sharded_loading import build_model

ROUTES = {"DDP": ["--backend", "ddp"], "ZeRO-1": ["--zero", "1"], "FSDP2": ["--backend", "fsdp"]}
PEAK = re.compile(r"rank (\d) holds .*?, peak ([\d.]+) GiB \(after step 1\)")


def rows(n: int) -> list[dict]:
    return [{"text": " ".join(f"word{(i * 7 + j) % 97}" for j in range(40 + i % 23))} for i in range(n)]


def run_route(base: Path, data: Path, out: Path, flags: list[str], args) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    options = dict(max_steps=args.steps, max_seq_len=args.seq, micro_batch_size=2, grad_accum=2, rank=16, optim="adamw", nproc=2)
    proc = subprocess.run(train_argv(base, data, out, *flags, "--precision", args.precision, **options), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(flags)}:\n{proc.stderr[-3000:]}")
    peaks = {int(rank): float(gib) for rank, gib in PEAK.findall(proc.stderr)}
    if sorted(peaks) != [0, 1]:
        raise SystemExit(f"expected a memory line from both ranks:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss" in s]
    warm = steps[1:] or steps  # the first step builds what the layers keep (and compiles nothing here)
    return {
        "step_seconds": [s["step_seconds"] for s in warm],
        "step_tokens": warm[0]["tokens_per_s"] * warm[0]["step_seconds"],
        "peak_gib": peaks,
        "losses": [s["loss"] for s in steps],
    }


def summary(runs: list[dict]) -> dict:
    """A route's repeats: the median warm step, the largest peak per rank, the first repeat's losses."""
    seconds = statistics.median(t for run in runs for t in run["step_seconds"])
    peaks = {rank: max(run["peak_gib"][rank] for run in runs) for rank in (0, 1)}
    return {
        "step_seconds": seconds,
        "tokens_per_s": runs[0]["step_tokens"] / seconds,
        "peak_gib": peaks,
        "losses": runs[0]["losses"],
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default=None, help="bf16 on a GPU, fp32 on a CPU (default)")
    parser.add_argument("--seq", type=int, default=None, help="--max-seq-len (default 256; 64 with --tiny)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each route, round-robin")
    args, work = bench_options(8, "a 2-layer model, 3 steps", "ddp-vs-sharded-", parser)
    import torch  # noqa: PLC0415 - only to pick the default precision, after the options parse

    args.precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    args.seq = args.seq or (64 if args.tiny else 256)
    args.steps = 3 if args.tiny and args.steps == 8 else args.steps
    base = build_model(work / ("tiny" if args.tiny else "model"), args.tiny)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(64)))
    runs: dict[str, list[dict]] = {name: [] for name in ROUTES}
    for _ in range(args.repeats):
        for name, flags in ROUTES.items():
            runs[name].append(run_route(base, data, work / name, flags, args))
    results = {name: summary(route_runs) for name, route_runs in runs.items()}
    (work / "results.json").write_text(json.dumps(results, indent=2))
    params = sum(p.stat().st_size for p in base.glob("*.safetensors")) / 2**30
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    print(
        f"model: {params:.2f} GiB of bf16 safetensors, LoRA rank 16 on every linear layer; 2 ranks on {where}, --precision "
        f"{args.precision}, micro-batch 2 x {args.seq} tokens, 2 accumulation steps, {args.steps} steps, {args.repeats} run(s) of each"
    )
    print("| route | step time (s) | tokens/s | peak rank 0 (GiB) | peak rank 1 (GiB) | step time vs DDP |")
    print("|---|---|---|---|---|---|")
    ddp = results["DDP"]["step_seconds"]
    for name, r in results.items():
        print(
            f"| {name} | {r['step_seconds']:.3f} | {r['tokens_per_s']:,.0f} | {r['peak_gib'][0]:.2f} | {r['peak_gib'][1]:.2f} | "
            f"{r['step_seconds'] / ddp:.2f}x |"
        )


if __name__ == "__main__":
    main()
