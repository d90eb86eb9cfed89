"""Side by side, one run: `lora-tune train` (its defaults) vs HF `Trainer` + PEFT (padded batches)
vs TRL `SFTTrainer` (packing, padding-free), same model, data, LoRA, prompt and checkpointing.

Model: Llama-shaped, random fp32 weights, 32,000-row vocabulary (hidden 512, intermediate 1376,
4 layers, 8 heads, 4 KV heads). Data, generated: alpaca rows whose lengths are long-tailed
(log-normal word counts: median ~60 words, a few of several hundred), the Stanford prompt on every
route, the loss on the response only. LoRA r16 / alpha 32 / dropout as lora-tune's default on every
linear layer of the blocks; non-reentrant gradient checkpointing; micro-batch 4 x 1,024 tokens
(TRL: one padding-free row of 4,096 tokens, its packing unit); lr 2e-4; one epoch.

Each route runs in a fresh interpreter; reported: whole-process wall time (imports included), real
(non-padding) tokens per second of training, peak RSS (VmHWM) and the final training loss (mean
of the last 5 logged steps), then the ratios of lora-tune to each peer.

    python benchmarks/train_vs_peers.py [--samples 128] [--cases long-tail equal-length] [--routes ...] [--repeats N] [--workdir DIR] [--tiny]

Two cases, both by default: long-tail samples (where packing removes the padding), and equal-length
samples that need no padding (~930 tokens each, 64 of them: every route does the same compute per
step). Routes: lora-tune with its defaults and with `--compile`, HF Trainer + PEFT, TRL. Besides
throughput over the whole epoch (the first step included: compilation is paid there), the median
optimizer step after the first is reported, and its ratio on equal-length data. `--repeats N` runs
every route N times, round robin (a slow spell of the machine then hits every route alike), reports
each figure's median and prints every repeat's ratios: on this 2-core machine a single run's ratio
moves by up to ~20%, mostly with the peers' step times. On a GPU
(`benchmarks/gpu_bench.sh`): `--shape 8b --precision bf16|4bit --seq N --micro-batch 1 --max-steps K`
runs a Llama-3-8B-shaped model with random weights, reports peak `max_memory_allocated`, MFU and the
plan's figure for the same setup; `--json FILE` appends the results.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

from commands import run_python  # benchmarks/ is on sys.path: these run as scripts
from peak_rss import PEAK

# The data the HF and TRL routes train on: the Stanford prompt rendered once, here, so all routes
# see the same text (lora-tune renders the same template from the alpaca columns itself).
COMMON = (
    PEAK
    + r"""
import json, sys, time
from lora_tune.data.formats.alpaca import NO_INPUT as ALPACA_NO_INPUT
from lora_tune.data.formats.alpaca import WITH_INPUT as ALPACA_WITH_INPUT
rows = [json.loads(line) for line in open(sys.argv[2])]
def prompt(r):
    return (ALPACA_WITH_INPUT if r["input"] else ALPACA_NO_INPUT).format(instruction=r["instruction"], input=r["input"])
"""
)

PEER_MODEL = r"""
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
cfg = json.loads(sys.argv[3])
cuda = torch.cuda.is_available()
def load_model():
    kwargs = {"dtype": torch.float32 if cfg["precision"] == "fp32" else torch.bfloat16}
    if cfg["precision"] == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    if cuda:
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **kwargs)
    if cfg["precision"] == "4bit":
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
def common_args():
    return dict(num_train_epochs=1, learning_rate=2e-4, logging_steps=1, save_strategy="no", report_to="none", gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": False}, seed=cfg["seed"], disable_tqdm=True, use_cpu=not cuda,
                bf16=cfg["precision"] != "fp32", max_steps=cfg["max_steps"] or -1)
def device_peak():
    return torch.cuda.max_memory_allocated() if cuda else None
from transformers import TrainerCallback
class StepTimes(TrainerCallback):  # each optimizer step's seconds, as lora-tune's metrics log them
    def __init__(self):
        self.seconds = []
    def on_step_begin(self, args, state, control, **kwargs):
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.t)
step_times = StepTimes()
"""

HF_TRAINER = (
    COMMON
    + PEER_MODEL
    + r"""
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments
tok = AutoTokenizer.from_pretrained(sys.argv[1])
def encode(r):
    p = tok(prompt(r))["input_ids"]
    a = tok(r["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = (p + a)[: cfg["max_seq_len"]]
    return {"input_ids": ids, "labels": ([-100] * len(p) + a)[: cfg["max_seq_len"]], "attention_mask": [1] * len(ids)}
data = Dataset.from_list([encode(r) for r in rows])
model = get_peft_model(load_model(), LoraConfig(r=16, lora_alpha=32, lora_dropout=cfg["dropout"], target_modules="all-linear", task_type="CAUSAL_LM"))
rows_per_pass = 1 if cfg.get("accumulate") else cfg["micro_batch_size"]  # the accumulated route: a micro-batch's rows one at a time
args = TrainingArguments(output_dir=sys.argv[4], per_device_train_batch_size=rows_per_pass,
                         gradient_accumulation_steps=cfg["micro_batch_size"] // rows_per_pass, **common_args())
trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100),
                  callbacks=[step_times])
t = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - t
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
steps = trainer.state.global_step
tokens = sum(len(x) for x in data["input_ids"][: steps * cfg["micro_batch_size"]]) if cfg["max_steps"] else sum(len(x) for x in data["input_ids"])
print("RESULT", json.dumps({"train_seconds": seconds, "tokens": tokens, "peak": peak(), "device_peak": device_peak(), "losses": losses,
                            "step_seconds": step_times.seconds}))
"""
)

TRL_SFT = (
    COMMON
    + PEER_MODEL
    + r"""
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
data = Dataset.from_list([{"prompt": prompt(r), "completion": r["output"]} for r in rows])
model = load_model()
args = SFTConfig(output_dir=sys.argv[4], per_device_train_batch_size=1, packing=True, padding_free=True,
                 max_length=cfg["micro_batch_size"] * cfg["max_seq_len"], **common_args())
peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=cfg["dropout"], target_modules="all-linear", task_type="CAUSAL_LM")
trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=peft, callbacks=[step_times])
t = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - t
rows_done = trainer.train_dataset["input_ids"][: trainer.state.global_step] if cfg["max_steps"] else trainer.train_dataset["input_ids"]
tokens = sum(len(x) for x in rows_done)
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print("RESULT", json.dumps({"train_seconds": seconds, "tokens": tokens, "peak": peak(), "device_peak": device_peak(), "losses": losses,
                            "step_seconds": step_times.seconds}))
"""
)

LORA_TUNE = (
    PEAK
    + r"""
import json, sys, time
from lora_tune.cli import main
cfg = json.loads(sys.argv[3])
argv = ["train", "--base", sys.argv[1], "--data", sys.argv[2], "--output-dir", sys.argv[4], "--precision", cfg["precision"], "--rank", "16",
        "--alpha", "32", "--micro-batch-size", str(cfg["micro_batch_size"]), "--max-seq-len", str(cfg["max_seq_len"]), "--lr", "2e-4",
        "--epochs", "1", "--seed", str(cfg["seed"]), "--logging-steps", "1"] + (["--max-steps", str(cfg["max_steps"])] if cfg["max_steps"] else [])
argv += (["--compile"] if cfg.get("compile") else []) + (["--gradient-checkpointing", cfg["checkpointing"]] if cfg.get("checkpointing") else [])
argv += ["--tiled-mlp", cfg["tiled_mlp"]] if cfg.get("tiled_mlp") else []
t = time.perf_counter()
code = main(argv)
seconds = time.perf_counter() - t
assert code == 0
rows = [json.loads(line) for line in open(sys.argv[4] + "/metrics.jsonl")]
steps = [r for r in rows if "loss" in r]
train_seconds = sum(r["step_seconds"] for r in steps)
import torch
device_peak = max(r["peak_memory_bytes"] for r in steps) if torch.cuda.is_available() else None
print("RESULT", json.dumps({"train_seconds": train_seconds, "tokens": steps[-1]["tokens_seen"], "peak": peak(), "device_peak": device_peak,
                            "losses": [r["loss"] for r in steps], "step_seconds": [r["step_seconds"] for r in steps]}))
"""
)

# name -> (script, what the route adds to the shared settings)
ROUTES = {
    "lora-tune train (defaults)": (LORA_TUNE, {}),
    "lora-tune train --compile": (LORA_TUNE, {"compile": True}),
    # On a GPU auto keeps the activations of the layers that fit; these checkpoint every layer (on a
    # CPU, with no device budget, auto recomputes every layer but the last, which costs no more memory).
    "lora-tune train --gradient-checkpointing on": (LORA_TUNE, {"checkpointing": "on"}),
    "lora-tune train --compile --gradient-checkpointing on": (LORA_TUNE, {"compile": True, "checkpointing": "on"}),
    # Long rows (benchmarks/long_context_gpu.sh): every layer checkpointed, the MLPs tiled or not.
    "lora-tune train --gradient-checkpointing on --tiled-mlp on": (LORA_TUNE, {"checkpointing": "on", "tiled_mlp": "on"}),
    "lora-tune train --gradient-checkpointing on --tiled-mlp off": (LORA_TUNE, {"checkpointing": "on", "tiled_mlp": "off"}),
    "HF Trainer + PEFT (padded)": (HF_TRAINER, {}),
    # The same optimizer steps with a micro-batch's rows run one at a time (gradient accumulation): the
    # peer's counterpart of lora-tune's passes on a CPU (lora_tune.data.batching.passes).
    "HF Trainer + PEFT (padded, rows accumulated)": (HF_TRAINER, {"accumulate": True}),
    "TRL SFTTrainer (packing, padding-free)": (TRL_SFT, {}),
}

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which one their they all "
    "model data train loss token layer weight memory speed batch sample text answer question value result number"
).split()


def long_tail_rows(n: int, seed: int, equal_length: bool) -> list[dict]:
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        if equal_length:
            instruction, answer = words(200), words(430)
        else:
            total = min(700, max(8, int(rng.lognormvariate(math.log(60), 0.9))))
            instruction, answer = words(max(3, total // 3)), words(max(3, total - total // 3))
        rows.append({"instruction": instruction, "input": "" if i % 3 else words(10), "output": answer})
    return rows


SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=4000, num_attention_heads=8, num_key_value_heads=4),
    "tiny4": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=4000, num_attention_heads=8, num_key_value_heads=4
    ),
    "cpu": dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=4, vocab_size=32000, num_attention_heads=8, num_key_value_heads=4
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        vocab_size=128256,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
}


def build_model(folder: Path, shape: str, corpus: list[str]) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (folder / "config.json").exists():
        return folder
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=2000,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random weights, built where they are fast to make
        model = LlamaForCausalLM(
            LlamaConfig(
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=16384, **SHAPES[shape]
            )
        )
    model.to(torch.bfloat16 if shape == "8b" else torch.float32).save_pretrained(folder)
    del model
    fast.save_pretrained(folder)
    return folder


def run_route(
    script: str, base: Path, data: Path, cfg: dict, out: Path, preloaded: bool = False, python: str | None = None, watch=None
) -> dict:
    """A route's figures. `preloaded` (the test suite's tiny shapes): forked with the libraries
    imported (commands.run_python), where a real run starts each route in a fresh interpreter;
    `python`, `watch`: as run_python's."""
    t = time.perf_counter()
    proc = run_python(script, [str(base), str(data), json.dumps(cfg), str(out)], preloaded, python, watch)
    wall = time.perf_counter() - t
    line = next((row for row in proc.stdout.splitlines() if row.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"route failed:\n{proc.stderr[-4000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    result["wall"] = wall
    return result


def flops_per_token(config: dict, seq: int) -> float:
    """Training FLOPs per token of a LoRA step with checkpointing: forward, the recompute, and the
    backward to the inputs (the frozen base needs no weight gradients): 3 x 2N, plus attention."""
    h, layers, v = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    n = layers * (2 * h * h + 2 * h * kv + 3 * h * config["intermediate_size"]) + v * h
    attention = layers * 2 * 2 * seq * h / 2  # QK^T and AV over a causal half
    return 3 * (2 * n + attention)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2


def summarise(repeats: list[dict]) -> dict:
    """A route's figures over its repeats: the median of each; the losses are the first repeat's
    (lora-tune's are the same on every repeat). A run's median step leaves out its first step, which
    pays compilation."""
    for r in repeats:
        r["first_step"], r["median_step"] = r["step_seconds"][0], median(r["step_seconds"][1:] or r["step_seconds"])
    summary = {**repeats[0], "repeats": repeats}
    for key in ("wall", "train_seconds", "peak", "first_step", "median_step"):
        summary[key] = median([r[key] for r in repeats])
    if repeats[0].get("device_peak") is not None:
        summary["device_peak"] = median([r["device_peak"] for r in repeats])
    return summary


def run_case(args, equal_length: bool, work: Path) -> dict:
    """One data case, every route on it, its table and ratios printed; returns the results."""
    from lora_tune.config import TrainConfig
    from lora_tune.planner import architecture
    from lora_tune.planner import memory as plan

    shape = args.shape or ("tiny" if args.tiny else "cpu")
    seq = args.seq or (256 if args.tiny else 1024)
    n = 16 if args.tiny else (64 if equal_length and args.samples == 128 else args.samples)
    rows = long_tail_rows(n, seed=0, equal_length=equal_length)
    data = work / ("equal.jsonl" if equal_length else "long_tail.jsonl")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = build_model(work / f"model-{shape}", shape, [" ".join(r.values()) for r in rows])
    cfg = {
        "micro_batch_size": args.micro_batch,
        "max_seq_len": seq,
        "seed": 42,
        "dropout": TrainConfig.model_fields["dropout"].default,
        "precision": args.precision,
        "max_steps": args.max_steps,
    }
    routes = [name for name in args.routes if not (ROUTES[name][1].get("compile") and args.precision == "4bit")]
    for name in sorted(set(args.routes) - set(routes), key=args.routes.index):
        print(f"{name}: left out at 4-bit (bitsandbytes' layers don't compile; lora-tune refuses the combination)")
    runs: dict[str, list[dict]] = {name: [] for name in routes}
    for _ in range(args.repeats):  # round robin: a slow spell of the machine hits every route alike
        for name in routes:
            out = work / (("equal-" if equal_length else "long-tail-") + "".join(c if c.isalnum() else "_" for c in name))
            if out.exists():
                shutil.rmtree(out)
            script, extra = ROUTES[name]
            runs[name].append(run_route(script, base, data, {**cfg, **extra}, out, preloaded=shape.startswith("tiny")))
    results = {name: summarise(repeats) for name, repeats in runs.items()}
    print(
        f"{n} {'equal-length' if equal_length else 'long-tail'} alpaca samples, Llama-shaped ({shape}) {args.precision} "
        "model, LoRA r16 "
        f"all-linear, dropout {cfg['dropout']}, checkpointing, micro-batch {cfg['micro_batch_size']} x {seq} tokens; "
        + (f"{args.max_steps} steps" if args.max_steps else "one epoch")
    )
    config = json.loads((base / "config.json").read_text())
    estimate = plan.estimate(
        architecture.load_architecture(str(base)),
        plan.Setup(precision=args.precision, rank=16, micro_batch_size=args.micro_batch, max_seq_len=seq, optim="adamw_8bit"),
    )
    on_gpu = any(r.get("device_peak") for r in results.values())
    print(
        "| route | wall s | real tokens/s (training) | first step s | median step s | peak RSS MiB | final loss |"
        + (" peak GPU GiB | MFU |" if on_gpu else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|---|" if on_gpu else ""))
    for name, r in results.items():
        final = sum(r["losses"][-5:]) / len(r["losses"][-5:])
        line = (
            f"| {name} | {r['wall']:.1f} | {r['tokens'] / r['train_seconds']:,.0f} | {r['first_step']:.2f} | "
            f"{r['median_step']:.2f} | {r['peak'] / 2**20:,.0f} | {final:.4f} |"
        )
        if on_gpu:
            mfu = r["tokens"] / r["train_seconds"] * flops_per_token(config, seq) / 989e12  # H100/H200 dense bf16 peak
            line += f" {r['device_peak'] / 2**30:.2f} | {100 * mfu:.1f}% |"
        print(line)
    print()
    # Per step: the median optimizer step after the first (which pays compilation); with equal-length
    # samples every route's step holds the same samples, so it is the per-step speed ratio.
    for ours_name in [name for name in results if name.startswith("lora-tune")]:
        ours = results[ours_name]
        for name, r in results.items():
            if name.startswith("lora-tune"):
                continue
            per_step = r["median_step"] / ours["median_step"]
            print(
                f"{ours_name} vs {name}: speed {r['train_seconds'] / ours['train_seconds']:.2f}x (training), "
                f"{r['wall'] / ours['wall']:.2f}x (whole process)"
                + (f", {per_step:.2f}x per step (median)" if equal_length else "")
                + f"; peak RSS {ours['peak'] / r['peak']:.2f}x"
                + (f"; peak GPU memory {ours['device_peak'] / r['device_peak']:.2f}x" if on_gpu else "")
            )
            if args.repeats > 1:
                pairs = list(zip(ours["repeats"], r["repeats"], strict=True))
                print(
                    "  each repeat: training "
                    + " ".join(f"{b['train_seconds'] / a['train_seconds']:.2f}x" for a, b in pairs)
                    + (", per step " + " ".join(f"{b['median_step'] / a['median_step']:.2f}x" for a, b in pairs) if equal_length else "")
                    + ", peak RSS "
                    + " ".join(f"{a['peak'] / b['peak']:.2f}x" for a, b in pairs)
                )
    ours = results.get("lora-tune train (defaults)")
    if ours is not None and on_gpu:
        planned = estimate.per_device["total_bytes"] - plan.CUDA_CONTEXT
        print(
            f"plan vs measured (lora-tune): planned {planned / 2**30:.2f} GiB, measured {ours['device_peak'] / 2**30:.2f} GiB, "
            f"ratio {planned / ours['device_peak']:.2f}"
        )
    print()
    return {
        "case": "equal-length" if equal_length else "long-tail",
        "shape": shape,
        "precision": args.precision,
        "seq": seq,
        "micro_batch": args.micro_batch,
        "results": results,
        "plan_total_bytes": estimate.per_device["total_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=128, help="long-tail samples (the equal-length case has 64 of ~930 tokens)")
    parser.add_argument("--cases", nargs="+", choices=["long-tail", "equal-length"], default=["long-tail", "equal-length"])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and 16 samples (for the test suite)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (default: cpu; tiny with --tiny)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "4bit"], default="fp32")
    parser.add_argument("--seq", type=int, default=None, help="--max-seq-len (default 1024; 256 with --tiny)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=None, help="stop every route after this many optimizer steps")
    parser.add_argument("--routes", nargs="+", default=[r for r in ROUTES if "gradient-checkpointing" not in r], choices=list(ROUTES))
    parser.add_argument("--json", default=None, help="append the results to this JSON-lines file")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every route this many times, round robin, and report the medians (ratios of each repeat too)",
    )
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="train-vs-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        summary = run_case(args, case == "equal-length", work)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
