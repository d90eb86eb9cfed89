"""Rows -> tokenized samples, at 20k / 200k / 1M generated long-tail alpaca rows: lora-tune's data
stage (batched `datasets.map`, Arrow cache, memory-mapped) vs the per-row approach it replaced (one
Python loop over `datasets` rows into Python lists, every process, every start).

For each size, in fresh interpreters: the per-row route's wall time and peak RSS; lora-tune's first
run (empty cache) and second run (cached); and the peak RSS of a one-step training run over the
data, whose growth from 20k to 200k rows shows that samples are not held as Python objects.

    python benchmarks/data_prep.py [--sizes 20000 200000 1000000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from commands import train_argv  # benchmarks/ is on sys.path: these run as scripts
from peak_rss import PEAK

# What lora-tune did before: load with datasets, then tokenize row by row into Python lists.
PER_ROW = (
    PEAK
    + r"""
import sys, time, json
t = time.perf_counter()
import datasets
from transformers import AutoTokenizer
from lora_tune.data.formats.alpaca import NO_INPUT as ALPACA_NO_INPUT
from lora_tune.data.formats.alpaca import WITH_INPUT as ALPACA_WITH_INPUT
tok = AutoTokenizer.from_pretrained(sys.argv[1])
records = datasets.load_dataset("json", data_files=sys.argv[2], split="train", cache_dir=sys.argv[3])
samples = []
for r in records:
    prompt = (ALPACA_WITH_INPUT if r["input"] else ALPACA_NO_INPUT).format(instruction=r["instruction"], input=r["input"])
    p = tok(prompt)["input_ids"]
    a = tok(r["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = (p + a)[:2048]
    samples.append((ids, ([-100] * len(p) + a)[:2048]))
print("RESULT", json.dumps({"seconds": time.perf_counter() - t, "peak": peak(), "samples": len(samples)}))
"""
)

OURS = (
    PEAK
    + r"""
import sys, time, json
t = time.perf_counter()
from lora_tune.config import TrainConfig
from lora_tune.data.prepare import prepare_data
from lora_tune.models.loading import load_tokenizer
cfg = TrainConfig(base=sys.argv[1], data=sys.argv[2], output_dir="unused", max_seq_len=2048, data_cache_dir=sys.argv[3])
tokenizer = load_tokenizer(sys.argv[1])
imported = time.perf_counter()  # what follows is the data stage itself (imports are paid by any run)
prepared = prepare_data(cfg, tokenizer)
print("RESULT", json.dumps({"seconds": time.perf_counter() - t, "stage": time.perf_counter() - imported, "peak": peak(), "samples": len(prepared.train)}))
"""
)

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which one their they all "
    "model data train loss token layer weight memory speed batch sample text answer question value result number"
).split()


def write_rows(path: Path, n: int) -> None:
    rng = random.Random(n)
    with open(path, "w") as f:
        for _i in range(n):
            total = min(700, max(8, int(rng.lognormvariate(math.log(60), 0.9))))
            words = [rng.choice(WORDS) for _ in range(total)]
            k = max(3, total // 3)
            f.write(json.dumps({"instruction": " ".join(words[:k]), "input": "", "output": " ".join(words[k:])}) + "\n")


def run(script: str, *args) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True)
    line = next((row for row in proc.stdout.splitlines() if row.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(proc.stderr[-3000:])
    return {**json.loads(line.removeprefix("RESULT ")), "wall": time.perf_counter() - t}


def training_peak(base: Path, data: Path, cache: Path, out: Path) -> float:
    """Peak RSS (MiB) of a one-step `lora-tune train` over the data (its cache already built)."""
    cmd = train_argv(base, data, out, max_steps=1, precision="fp32", rank=4, max_seq_len=2048, data_cache_dir=cache)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["peak_memory_bytes"] / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000, 1_000_000])
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from lora_tune.models.tiny.model import build_tiny_llama

    work = Path(args.workdir or tempfile.mkdtemp(prefix="data-prep-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "tiny" if (work / "tiny" / "config.json").exists() else build_tiny_llama(work / "tiny")
    print("Whole-process wall times; 'stage' = the data stage alone, after imports and the tokenizer (which any run pays).")
    print(
        "| rows | per-row approach s | its peak RSS MiB | lora-tune first run s (stage) | cached run s (stage) | its peak RSS "
        "MiB | first / per-row | cached / first (stages) | training peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        data = work / f"rows-{n}.jsonl"
        if not data.exists():
            write_rows(data, n)
        cache = work / f"cache-{n}"
        subprocess.run(["rm", "-rf", str(cache), str(work / f"hf-{n}")])
        before = run(PER_ROW, base, data, work / f"hf-{n}")
        first = run(OURS, base, data, cache)
        cached = run(OURS, base, data, cache)
        peak = training_peak(base, data, cache, work / f"train-{n}")
        subprocess.run(["rm", "-rf", str(work / f"train-{n}")])
        print(
            f"| {n:,} | {before['wall']:.1f} | {before['peak'] / 2**20:,.0f} | {first['wall']:.1f} ({first['stage']:.1f}) | "
            f"{cached['wall']:.1f} ({cached['stage']:.1f}) "
            f"| {first['peak'] / 2**20:,.0f} | {first['wall'] / before['wall']:.2f} | {cached['wall'] / first['wall']:.2f} "
            f"({cached['stage'] / first['stage']:.2f}) | {peak:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
