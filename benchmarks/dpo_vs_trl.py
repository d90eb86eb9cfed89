"""Side by side, one run: `lora-tune train --objective dpo` (its defaults: packed pairs, chunked
log-probabilities, the reference precomputed or per step as it decides) vs TRL `DPOTrainer` at its
best settings for a LoRA run: the PEFT model's own base as the reference (no second model), its
fused LM head (no full logits), per-step or precomputed reference log-probabilities. TRL's
`padding_free` is switched off in this release (it warns and pads), so TRL pads.

Model: Llama-shaped, random fp32 weights, 32,000-row vocabulary (train_vs_peers.py's `cpu` shape).
Data, generated: plain-text pairs whose lengths are long-tailed (log-normal word counts: prompt
median ~30 words, each answer ~50, a few of several hundred). Same LoRA (r16 / alpha 32 on every
linear layer of the blocks, dropout 0), non-reentrant gradient checkpointing, beta 0.1, lr 5e-5,
one epoch; a micro-batch holds at most 4 x 2 x 1,024 tokens on every route (TRL: 4 pairs, each
sequence up to 1,024 tokens, padded to the longest; lora-tune: 4 rows of 2 x 1,024 tokens filled
with whole pairs).

Each route runs in a fresh interpreter; reported: whole-process wall time, pairs per second of
training (the reference pass included: TRL precomputes it while the trainer is built, so its time
runs from the construction), peak RSS (VmHWM) and its rise over the RSS when training starts, and
the final loss; then the ratios of lora-tune to each TRL route. Run it on an idle machine: the
routes run one after another, and a busy core skews their ratio.

    python benchmarks/dpo_vs_trl.py [--pairs 96] [--workdir DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
from pathlib import Path

from peak_rss import PEAK  # benchmarks/ is on sys.path: these run as scripts
from train_vs_peers import WORDS, build_model, run_route

RSS = (
    PEAK
    + """
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
"""
)

TRL_DPO = (
    RSS
    + r"""
import json, sys, time
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
cfg = json.loads(sys.argv[3])
rows = [json.loads(line) for line in open(sys.argv[2])]
tok = AutoTokenizer.from_pretrained(sys.argv[1])
cuda = torch.cuda.is_available()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32 if cfg["precision"] == "fp32" else torch.bfloat16,
                                             **({"device_map": {"": 0}} if cuda else {}))
args = DPOConfig(output_dir=sys.argv[4], per_device_train_batch_size=cfg["micro_batch_size"], max_length=cfg["max_seq_len"],
                 precompute_ref_log_probs=cfg["precompute"], beta=0.1, learning_rate=5e-5, num_train_epochs=1, logging_steps=1,
                 save_strategy="no", report_to="none", gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                 seed=cfg["seed"], disable_tqdm=True, use_cpu=not cuda, bf16=cfg["precision"] != "fp32")
peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
before = rss()
if cuda:
    torch.cuda.reset_peak_memory_stats()
t = time.perf_counter()  # from the trainer's construction: it tokenizes (well under a second here) and precomputes the reference
trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=peft)
trainer.train()
seconds = time.perf_counter() - t
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print("RESULT", json.dumps({"train_seconds": seconds, "pairs": len(trainer.train_dataset), "peak": peak(), "rise": peak() - before,
                            "device_peak": torch.cuda.max_memory_allocated() if cuda else None, "losses": losses}))
"""
)

LORA_TUNE_DPO = (
    RSS
    + r"""
import json, logging, re, sys
import torch
from lora_tune.cli import build_parser, config_from_args, quiet_libraries, setup_logging
from lora_tune.config import TrainConfig
from lora_tune.preflight import check_inputs
from lora_tune.training.recipe import Recipe
cfg = json.loads(sys.argv[3])
seen = {"reference_seconds": 0.0}
class Watch(logging.Handler):  # the RSS when training starts, the reference pass's time
    def emit(self, record):
        text = record.getMessage()
        found = re.search(r"reference log-probabilities of \d+ \+ \d+ units computed in ([\d.]+) s", text)
        if found:
            seen["reference_seconds"] = float(found.group(1))
argv = ["train", "--base", sys.argv[1], "--data", sys.argv[2], "--output-dir", sys.argv[4], "--objective", "dpo", "--beta", "0.1",
        "--precision", cfg["precision"], "--rank", "16", "--alpha", "32", "--dropout", "0",
        "--micro-batch-size", str(cfg["micro_batch_size"]), "--max-seq-len", str(cfg["max_seq_len"]), "--lr", "5e-5", "--epochs", "1",
        "--seed", str(cfg["seed"]), "--logging-steps", "1", "--no-data-cache"]
run = config_from_args(TrainConfig, build_parser().parse_args(argv))
setup_logging()
quiet_libraries(True)
logging.getLogger("lora_tune").addHandler(Watch())
recipe = Recipe(check_inputs(run))  # the recipe's stages, so the RSS is read when training starts
try:
    recipe.setup()
    seen["before"] = rss()
    recipe.train()
    recipe.save()
finally:
    recipe.cleanup()
rows = [json.loads(line) for line in open(sys.argv[4] + "/metrics.jsonl")]
steps = [r for r in rows if "loss" in r]
train_seconds = sum(r["step_seconds"] for r in steps) + seen["reference_seconds"]
pairs = sum(1 for _ in open(sys.argv[2]))
print("RESULT", json.dumps({"train_seconds": train_seconds, "pairs": pairs, "peak": peak(), "rise": peak() - seen["before"],
                            "device_peak": max(r["peak_memory_bytes"] for r in steps) if torch.cuda.is_available() else None,
                            "losses": [r["loss"] for r in steps], "reference_seconds": seen["reference_seconds"]}))
"""
)

ROUTES = {
    "lora-tune train --objective dpo": (LORA_TUNE_DPO, {}),
    "TRL DPOTrainer (PEFT reference per step)": (TRL_DPO, {"precompute": False}),
    "TRL DPOTrainer (reference precomputed)": (TRL_DPO, {"precompute": True}),
}


def long_tail_pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)

    def words(median: float) -> str:
        k = min(600, max(3, int(rng.lognormvariate(math.log(median), 0.9))))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [{"prompt": words(30), "chosen": " " + words(50), "rejected": " " + words(50)} for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and 16 pairs (for the test suite)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "cpu"
    seq = 256 if args.tiny else 1024
    n = 16 if args.tiny else args.pairs
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dpo-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = long_tail_pairs(n, seed=0)
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = build_model(work / f"model-{shape}", shape, [" ".join(r.values()) for r in rows])
    cfg = {"micro_batch_size": 4, "max_seq_len": seq, "seed": 42, "precision": args.precision}
    results = {}
    for name in args.routes:
        script, extra = ROUTES[name]
        out = work / "".join(c if c.isalnum() else "_" for c in name)
        shutil.rmtree(out, ignore_errors=True)
        results[name] = run_route(script, base, data, {**cfg, **extra}, out, preloaded=args.tiny)
    print(
        f"{n} long-tail pairs, Llama-shaped ({shape}) {args.precision} model, LoRA r16 all-linear, checkpointing, "
        f"micro-batch up to 4 x 2 x {seq} tokens, beta 0.1; one epoch"
    )
    on_gpu = any(r.get("device_peak") for r in results.values())
    header = "| route | wall s | pairs/s (training) | peak RSS MiB | RSS rise in training MiB | final loss |"
    print(header + (" peak GPU GiB |" if on_gpu else ""))
    print("|---|---|---|---|---|---|" + ("---|" if on_gpu else ""))
    for name, r in results.items():
        final = sum(r["losses"][-5:]) / len(r["losses"][-5:])
        speed, peak, rise = r["pairs"] / r["train_seconds"], r["peak"] / 2**20, r["rise"] / 2**20
        line = f"| {name} | {r['wall']:.1f} | {speed:.2f} | {peak:,.0f} | {rise:,.0f} | {final:.4f} |"
        if on_gpu:
            line += f" {r['device_peak'] / 2**30:.2f} |"
        print(line)
    ours = results.get("lora-tune train --objective dpo")
    print()
    if ours is not None:
        for name, r in results.items():
            if r is ours:
                continue
            speed = (ours["pairs"] / ours["train_seconds"]) / (r["pairs"] / r["train_seconds"])
            print(
                f"vs {name}: pairs/s {speed:.2f}x; peak RSS {ours['peak'] / r['peak']:.2f}x; "
                f"RSS rise in training {ours['rise'] / max(r['rise'], 1):.2f}x"
                + (f"; peak GPU memory {ours['device_peak'] / r['device_peak']:.2f}x" if on_gpu else "")
            )


if __name__ == "__main__":
    sys.exit(main())
