"""`--compile` on train_vs_peers.py's Llama-shaped `cpu` model: compile time on a cold cache, start-up
on a warm one (a second run of the same setup), graphs compiled over a run of packed batches of
varying widths, and the loss curve against eager, in one run.

Three fresh `lora-tune train` processes on the same long-tail data (packed rows of several samples
and a partial last row, so widths and attention masks vary between micro-batches), `--max-steps 20`
over more than one epoch: eager; compiled with an empty Inductor cache (its own folder); compiled
again with that cache. Reported: each route's first-step seconds and median step after it, the
compile seconds and graphs the log reports (at step 1 and over the run), the cache's hits and
misses, and the largest relative difference of a step's loss from eager's.

    python benchmarks/compile_check.py [--steps 20] [--workdir DIR] [--tiny]
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from commands import bench_options, train_argv
from train_vs_peers import build_model, long_tail_rows

REPORT = re.compile(r"(step 1|over the run): compiled (\d+) graph\(s\) in ([\d.]+) s \(Inductor cache: (\d+) hit\(s\), (\d+) miss\(es\)\)")


def run(base: Path, data: Path, out: Path, seq: int, steps: int, extra: list[str], env: dict) -> dict:
    options = dict(precision="fp32", rank=16, micro_batch_size=4, max_seq_len=seq, max_steps=steps, epochs=3, optim="adamw")
    argv = train_argv(base, data, out, "--no-data-cache", *extra, **options)
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"route failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "loss" in r]
    reports = {when: tuple(float(x) for x in rest) for when, *rest in REPORT.findall(proc.stderr)}
    tokens = [b["tokens_seen"] - a["tokens_seen"] for a, b in zip([{"tokens_seen": 0}, *steps_], steps_, strict=False)]
    return {
        "first_step": steps_[0]["step_seconds"],
        "median_step": statistics.median(r["step_seconds"] for r in steps_[1:]),
        "losses": [r["loss"] for r in steps_],
        "step_tokens": tokens,
        "reports": reports,
        "wall": time.perf_counter() - t,
    }


def main() -> None:
    args, work = bench_options(20, "the tiny shape and short rows", "compile-check-")
    shape, seq, n = ("tiny", 256, 48) if args.tiny else ("cpu", 1024, 160)
    rows = long_tail_rows(n, seed=1, equal_length=False)
    data = work / "long_tail.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = build_model(work / f"model-{shape}", shape, [" ".join(r.values()) for r in rows])
    cache = tempfile.mkdtemp(prefix="inductor-cache-", dir=work)  # cold for the first compiled run
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    routes = {"eager": [], "compiled, cold cache": ["--compile"], "compiled, warm cache": ["--compile"]}
    results = {name: run(base, data, work / f"run{i}", seq, args.steps, extra, env) for i, (name, extra) in enumerate(routes.items())}
    eager = results["eager"]
    print(
        f"{n} long-tail alpaca samples packed into rows of {seq} tokens, Llama-shaped ({shape}) fp32 model, LoRA r16 all-linear, "
        f"checkpointing, micro-batch 4 rows, {args.steps} steps ({len(set(eager['step_tokens']))} distinct token counts per step)"
    )
    print("| route | wall s | first step s | median step s | graphs at step 1 | graphs over the run | compile s | cache hits / misses |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        first, run_ = r["reports"].get("step 1"), r["reports"].get("over the run")
        compiled = f"{first[0]:.0f} | {run_[0]:.0f} | {run_[1]:.1f} | {run_[2]:.0f} / {run_[3]:.0f}" if first and run_ else "- | - | - | -"
        print(f"| {name} | {r['wall']:.1f} | {r['first_step']:.2f} | {r['median_step']:.2f} | {compiled} |")
    print()
    for name in ("compiled, cold cache", "compiled, warm cache"):
        r = results[name]
        worst = max(abs(c - e) / abs(e) for c, e in zip(r["losses"], eager["losses"], strict=True))
        print(
            f"{name}: largest relative loss difference from eager over {len(r['losses'])} steps {worst:.1e}; "
            f"median step {eager['median_step'] / r['median_step']:.2f}x eager's"
        )


if __name__ == "__main__":
    main()
