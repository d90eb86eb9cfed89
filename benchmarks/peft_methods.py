"""PEFT methods side by side, one table: for each method lora-tune trains (LoRA and its inits, LoRA+,
DoRA, peft's other adapter types), `lora-tune train` vs HF Trainer + PEFT with the same peft config,
on the same data and the same number of steps: trainable parameters, median step time, peak RSS,
final eval loss, and the time to merge the adapter into the base (`lora-tune merge` vs peft's
merge_and_unload + save_pretrained).

The HF route's peft config is the lora-tune run's own adapter_config.json (for PiSSA/OLoRA: its init
and rank as trained, not the converted rank-2r LoRA lora-tune writes); LoRA+ there is peft's
create_loraplus_optimizer. Data: alpaca-style rows of random words (train_vs_peers.py's generator),
a quarter held out for evaluation. HF Trainer pads each micro-batch; lora-tune packs. The eval losses
are each tool's own (the same rows, each tool's own batching: comparable within a tool across methods
and, near enough, across tools).

Each route runs in a fresh interpreter. Run it on an idle machine: routes run one after another.

    python benchmarks/peft_methods.py [--steps 30] [--workdir DIR] [--tiny] [--methods lora pissa ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from peak_rss import PEAK  # benchmarks/ is on sys.path: these run as scripts
from train_vs_peers import build_model, long_tail_rows, run_route

# method -> lora-tune options (flag names without dashes)
METHODS = {
    "lora": {},
    "lora+ (ratio 16)": {"loraplus_lr_ratio": 16},
    "dora": {"dora": True},
    "pissa_niter_4": {"init_lora_weights": "pissa_niter_4"},
    "olora": {"init_lora_weights": "olora"},
    "eva": {"init_lora_weights": "eva"},
    "corda": {"init_lora_weights": "corda"},
    "lora-ga": {"init_lora_weights": "lora-ga"},
    "gaussian": {"init_lora_weights": "gaussian"},
    "oft": {"peft_type": "oft"},
    "boft": {"peft_type": "boft"},
    "loha": {"peft_type": "loha"},
    "lokr": {"peft_type": "lokr"},
    "vera": {"peft_type": "vera"},
    "ia3": {"peft_type": "ia3"},
    "adalora": {"peft_type": "adalora"},
    "miss": {"peft_type": "miss"},
    "hra": {"peft_type": "hra"},
}

LORA_TUNE = (
    PEAK
    + r"""
import json, re, sys, time
from lora_tune.cli import main
cfg = json.loads(sys.argv[3])
out = sys.argv[4]
class Tee:  # the run's log lines, read for its count of trainable parameters
    def __init__(self, stream):
        self.stream, self.text = stream, []
    def write(self, s):
        self.text.append(s)
        return self.stream.write(s)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stderr = Tee(sys.stderr)
argv = ["train", "--base", sys.argv[1], "--data", sys.argv[2], "--output-dir", out, "--precision", "fp32", "--rank", "16",
        "--alpha", "32", "--dropout", "0", "--optim", "adamw", "--lr", str(cfg["lr"]), "--max-steps", str(cfg["steps"]),
        "--micro-batch-size", "4", "--max-seq-len", str(cfg["seq"]), "--eval-split", "0.25", "--eval-steps", str(cfg["steps"]),
        "--seed", "42", "--logging-steps", "1", "--no-data-cache", "--gradient-checkpointing", "off"]
for k, v in cfg["options"].items():
    argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
assert main(argv) == 0
trainable = int(re.search(r"trainable parameters: ([\d,]+)", "".join(sys.stderr.text)).group(1).replace(",", ""))
rows = [json.loads(line) for line in open(out + "/metrics.jsonl")]
steps = sorted(r["step_seconds"] for r in rows if "loss" in r)
t = time.perf_counter()
assert main(["merge", "--adapter", out, "--output", out + "-merged", "--dtype", "fp32", "--no-verify"]) == 0
merge = time.perf_counter() - t
print("RESULT", json.dumps({"trainable": trainable, "step": steps[len(steps) // 2], "peak": peak(),
                            "eval_loss": [r["eval_loss"] for r in rows if "eval_loss" in r][-1], "merge": merge}))
"""
)

HF_PEFT = (
    PEAK
    + r"""
import json, random, sys, time
import torch
from datasets import Dataset
from peft import PeftConfig, get_peft_model
from peft.optimizers import create_loraplus_optimizer
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments
cfg = json.loads(sys.argv[3])
out = sys.argv[4]
peft_config = PeftConfig.from_pretrained(cfg["adapter"])
init = cfg["options"].get("init_lora_weights")
if init in ("pissa_niter_4", "olora", "corda", "lora-ga"):  # lora-tune writes them converted (rank 2r): the config as trained
    peft_config.r, peft_config.lora_alpha = peft_config.r // 2, peft_config.lora_alpha // 2
if init:
    peft_config.init_lora_weights = init.replace("-", "_")
peft_config.inference_mode = False
adalora = peft_config.peft_type == "ADALORA"
if adalora:  # peft's AdaLoRA loop: the penalty comes with the causal-LM forward's loss, the allocator after each step (below)
    peft_config.task_type = "CAUSAL_LM"
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = [json.loads(line) for line in open(sys.argv[2])]
texts = [f"{r['instruction']} {r['input']} {r['output']}" for r in rows]
random.Random(42).shuffle(texts)
held = len(texts) // 4
encode = lambda t: tok(t + tok.eos_token, truncation=True, max_length=cfg["seq"])  # noqa: E731
train, evaluation = Dataset.from_list([encode(t) for t in texts[held:]]), Dataset.from_list([encode(t) for t in texts[:held]])
collator = DataCollatorForLanguageModeling(tok, mlm=False)
first = [dict(collator([train[i] for i in range(j, j + 4)])) for j in range(0, 32, 4)]  # 8 micro-batches, as lora-tune's --init-batches
torch.manual_seed(42)
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
if init == "corda":  # peft's flow: covariance hooks (one sequence at a time), then the adapter
    from peft.tuners.lora.config import CordaConfig
    from peft.tuners.lora.corda import preprocess_corda
    peft_config.corda_config = CordaConfig(corda_method="ipm")
    def run_model():
        with torch.no_grad():
            for b in first:
                for ids, mask in zip(b["input_ids"], b["attention_mask"]):
                    base(input_ids=ids[mask.bool()].unsqueeze(0))
    preprocess_corda(base, peft_config, run_model=run_model)
if init == "lora-ga":
    from peft import LoraGAConfig, preprocess_loraga
    peft_config.lora_ga_config = LoraGAConfig()
    preprocess_loraga(base, peft_config, train_step=lambda: [base(**b).loss.backward() for b in first])
if init == "eva":
    from peft import EvaConfig
    peft_config.eva_config = EvaConfig(rho=1.0)
model = get_peft_model(base, peft_config)
if init == "eva":
    from peft import initialize_lora_eva_weights
    initialize_lora_eva_weights(model, dataloader=first, show_progress_bar=False)
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=cfg["lr"],
                         max_steps=cfg["steps"], lr_scheduler_type="cosine", logging_steps=1, save_strategy="no", report_to="none",
                         seed=42, disable_tqdm=True, use_cpu=True, optim="adamw_torch", max_grad_norm=1.0)
ratio = cfg["options"].get("loraplus_lr_ratio")
optimizers = (create_loraplus_optimizer(model, torch.optim.AdamW, lr=cfg["lr"], loraplus_lr_ratio=ratio), None) if ratio else (None, None)
trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation, data_collator=collator, optimizers=optimizers)
times = []
class StepTimes(TrainerCallback):
    def on_step_begin(self, *a, **k):
        self.t = time.perf_counter()
    def on_step_end(self, *a, **k):
        times.append(time.perf_counter() - self.t)
trainer.add_callback(StepTimes())
class Allocate(TrainerCallback):  # HF Trainer doesn't call it: peft's docs put it after the optimizer step, before zero_grad
    def on_optimizer_step(self, args, state, control, **k):
        model.base_model.update_and_allocate(state.global_step)
if adalora:
    trainer.add_callback(Allocate())
trainer.train()
eval_loss = trainer.evaluate()["eval_loss"]
if adalora:  # peft's forward adds its orthogonality penalty to evaluation's loss too: taken out, as lora-tune's eval loss has none
    model.eval()
    with torch.no_grad():
        eval_loss -= float(model(**first[0]).loss - model.base_model.model(**first[0]).loss)
t = time.perf_counter()
model.merge_and_unload().save_pretrained(out + "-merged")
merge = time.perf_counter() - t
times.sort()
print("RESULT", json.dumps({"trainable": trainable, "step": times[len(times) // 2], "peak": peak(), "eval_loss": eval_loss,
                            "merge": merge}))
"""
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer model, 3 steps, 3 methods (for the test suite; corda: peft's flow on the HF side)"
    )
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS))
    args = parser.parse_args()
    shape, steps, seq = ("tiny", 3, 128) if args.tiny else ("tiny4", args.steps, 256)
    methods = args.methods or (["lora", "corda", "oft"] if args.tiny else list(METHODS))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="peft-methods-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = long_tail_rows(64 if args.tiny else 256, seed=0, equal_length=False)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = build_model(work / f"model-{shape}", shape, [" ".join(r.values()) for r in rows])
    results = {}
    for method in methods:
        cfg = {"lr": 1e-3, "steps": steps, "seq": seq, "options": METHODS[method]}
        slug = "".join(c if c.isalnum() else "_" for c in method)
        for route, script in (("lora-tune", LORA_TUNE), ("HF Trainer + PEFT", HF_PEFT)):
            out = work / f"{slug}-{route[:4]}"
            for folder in (out, Path(f"{out}-merged")):
                shutil.rmtree(folder, ignore_errors=True)
            extra = {"adapter": str(work / f"{slug}-lora")} if route != "lora-tune" else {}
            results[(method, route)] = run_route(script, base, data, {**cfg, **extra}, out, preloaded=args.tiny)
    print(f"{len(rows)} alpaca rows of random words (a quarter held out), Llama-shaped ({shape}) fp32, {steps} steps of 4 x {seq} tokens")
    print("| method | route | trainable params | step ms (median) | peak RSS MiB | final eval loss | merge s |")
    print("|---|---|---|---|---|---|---|")
    for (method, route), r in results.items():
        print(
            f"| {method} | {route} | {r['trainable']:,} | {1000 * r['step']:.0f} | {r['peak'] / 2**20:,.0f} | {r['eval_loss']:.4f} | "
            f"{r['merge']:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
