"""Side by side: `lora-tune train` on image-text rows vs TRL `SFTTrainer` on the same rows, same
model, same LoRA, same optimizer steps.

Model: a Gemma 3 image-text model with random fp32 weights (the `cpu` shape: the language model
hidden 512, MLP 2048, 4 layers (2 sliding-window + 2 global), 8 heads, 4 KV heads, 32,000-row
vocabulary, tied head; a SigLIP tower of 4 layers, hidden 256, 224-pixel images in 14-pixel patches
pooled to 64 image tokens), built from lora-tune's tiny Gemma 3
(`lora_tune.models.tiny.vision.build_tiny_image_text_model`) with wider sizes, its processor resized
to match. `--tiny` trains that tiny checkpoint itself (64-pixel images, 4 image tokens).

Data, generated: one drawn picture per row (a coloured shape on a coloured ground), a question about
it and an answer that names it, then goes on for a long-tailed number of words (log-normal, median
~45); lora-tune reads it as chat rows with typed image parts (`{"type": "image", "image":
"img/3.png"}`, paths relative to the file), TRL as its documented vision dataset: `prompt` /
`completion` messages and an `images` column of images read from the same files (`datasets`'
`Image` feature, decoded when a batch is built). Both train on the answer only (TRL:
`completion_only_loss`, the prompt and its image tokens masked), every row fits the max length.

Same on both: LoRA r8 / alpha 16 / dropout 0 on the language model's q, k, v, o, gate, up, down
projections (the vision tower frozen, not adapted: the trainable parameter counts are printed and
must agree), fp32, torch AdamW, lr 2e-4 cosine without warmup, weight decay 0, gradient clipping
1.0, micro-batch 2 rows padded to the longest (neither packs image rows), max length 512, seed 42,
the same number of optimizer steps (one epoch). Each side keeps its own defaults otherwise: TRL
checkpoints every layer (non-reentrant), batches rows in random order, and its fused LM head scores
every position in chunks (log-probabilities, plus entropy and top-1 for its metrics; on a Triton GPU
only the labelled positions); lora-tune checkpoints as its memory plan decides, batches rows of
similar length together, and its chunked cross-entropy covers the label tokens only.

Each route runs in a fresh interpreter; reported: whole-process wall time (imports, loading, data
and training), training seconds, real (non-padding) tokens per second of training, start-up seconds
(wall less training), peak RSS (VmHWM), the final loss (mean of the last 5 steps), then lora-tune's
ratios to TRL. `--repeats N` runs both N times, round robin, and reports each figure's median (on a
shared 2-core machine one run's ratio moves by ~10-20%).

    python benchmarks/vlm_vs_trl.py [--rows 48] [--repeats 3] [--workdir DIR] [--tiny] [--json FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from peak_rss import PEAK  # benchmarks/ is on sys.path: these run as scripts
from train_vs_peers import PEER_MODEL, WORDS, median, run_route

# train_vs_peers' timer of each optimizer step (a TrainerCallback, `step_times`), as lora-tune's metrics log them
STEP_TIMES = PEER_MODEL[PEER_MODEL.index("from transformers import TrainerCallback") :]

# The language model's projections: what both routes adapt (the vision tower's q/k/v are left out).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

TRL_SFT = (
    PEAK
    + r"""
import json, sys, time
from pathlib import Path
import torch
from datasets import Dataset, Image, Sequence
from peft import LoraConfig
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import SFTConfig, SFTTrainer
cfg = json.loads(sys.argv[3])
folder = Path(sys.argv[2]).parent
rows = []
for line in open(sys.argv[2]):  # the same rows: the user's text and the image file, the answer
    user, answer = json.loads(line)["messages"]
    image = next(p["image"] for p in user["content"] if p["type"] == "image")
    text = next(p["text"] for p in user["content"] if p["type"] == "text")
    rows.append({"prompt": [{"role": "user", "content": text}], "completion": [{"role": "assistant", "content": answer["content"]}],
                 "images": [str(folder / image)]})
data = Dataset.from_list(rows).cast_column("images", Sequence(Image()))
processor = AutoProcessor.from_pretrained(sys.argv[1])
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32)
args = SFTConfig(output_dir=sys.argv[4], per_device_train_batch_size=cfg["micro_batch_size"], max_length=cfg["max_seq_len"],
                 learning_rate=cfg["lr"], lr_scheduler_type="cosine", optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0,
                 num_train_epochs=1, max_steps=cfg["max_steps"], logging_steps=1, save_strategy="no", report_to="none",
                 gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, seed=cfg["seed"],
                 disable_tqdm=True, use_cpu=True, bf16=False)
peft = LoraConfig(r=cfg["rank"], lora_alpha=2 * cfg["rank"], lora_dropout=0.0, task_type="CAUSAL_LM",
                  target_modules=r".*language_model.*\.(" + "|".join(cfg["targets"]) + ")")
"""
    + STEP_TIMES
    + r"""
trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=processor, peft_config=peft, callbacks=[step_times])
collate = trainer.data_collator  # TRL's DataCollatorForVisionLanguageModeling; counted, not changed
seen = {"real": 0, "padded": 0, "labels": 0}
def counting(examples):
    batch = collate(examples)
    seen["real"] += int(batch["attention_mask"].sum())
    seen["padded"] += batch["attention_mask"].numel()
    seen["labels"] += int((batch["labels"] != -100).sum())
    return batch
trainer.data_collator = counting
trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
t = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - t
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print("RESULT", json.dumps({"train_seconds": seconds, "tokens": seen["real"], "padded_tokens": seen["padded"],
                            "label_tokens": seen["labels"], "peak": peak(), "losses": losses, "step_seconds": step_times.seconds,
                            "trainable": trainable, "steps": trainer.state.global_step}))
"""
)

LORA_TUNE = (
    PEAK
    + r"""
import json, sys, time
from lora_tune.cli import main
cfg = json.loads(sys.argv[3])
argv = ["train", "--base", sys.argv[1], "--data", sys.argv[2], "--output-dir", sys.argv[4], "--precision", "fp32",
        "--rank", str(cfg["rank"]), "--alpha", str(2 * cfg["rank"]), "--dropout", "0", "--target-modules", *cfg["targets"],
        "--optim", "adamw", "--lr", str(cfg["lr"]), "--lr-scheduler", "cosine", "--weight-decay", "0", "--max-grad-norm", "1.0",
        "--micro-batch-size", str(cfg["micro_batch_size"]), "--max-seq-len", str(cfg["max_seq_len"]), "--max-steps", str(cfg["max_steps"]),
        "--seed", str(cfg["seed"]), "--logging-steps", "1", "--no-data-cache"]
code = main(argv)
assert code == 0, code
steps = [r for r in map(json.loads, open(sys.argv[4] + "/metrics.jsonl")) if "loss" in r]
from safetensors import safe_open
with safe_open(sys.argv[4] + "/adapter_model.safetensors", "pt") as f:
    trainable = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())
print("RESULT", json.dumps({"train_seconds": sum(r["step_seconds"] for r in steps), "tokens": steps[-1]["tokens_seen"], "peak": peak(),
                            "losses": [r["loss"] for r in steps], "step_seconds": [r["step_seconds"] for r in steps],
                            "trainable": trainable, "steps": steps[-1]["step"]}))
"""
)

ROUTES = {"lora-tune train": LORA_TUNE, "TRL SFTTrainer": TRL_SFT}

# The model of the full run (`cpu`): the tiny Gemma 3's config with these sizes; `tiny` (--tiny) keeps it as built.
SHAPES = {
    "tiny": None,  # build_tiny_image_text_model("gemma3") as it is
    "cpu": {
        "text_config": dict(
            hidden_size=512,
            intermediate_size=2048,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            query_pre_attn_scalar=64,
            vocab_size=32000,
            sliding_window=1024,
            max_position_embeddings=4096,
        ),
        "vision_config": dict(
            hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_hidden_layers=4, image_size=224, patch_size=14
        ),
        "mm_tokens_per_image": 64,
    },
}


def build_model(folder: Path, shape: str) -> Path:
    """The tiny Gemma 3 checkpoint, widened to `shape` (model and processor), saved to `folder`."""
    from lora_tune.models.tiny.vision import build_tiny_image_text_model

    if (folder / "config.json").exists():
        return folder
    if SHAPES[shape] is None:
        return build_tiny_image_text_model("gemma3", folder)
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    tiny = build_tiny_image_text_model("gemma3", folder.with_name(folder.name + "-tiny"))
    config = AutoConfig.from_pretrained(tiny)
    sizes = SHAPES[shape]
    for part in ("text_config", "vision_config"):
        for key, value in sizes[part].items():
            setattr(getattr(config, part), key, value)
    config.mm_tokens_per_image = sizes["mm_tokens_per_image"]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # as the tiny builder: Gemma 3's projection starts at zeros (every image would look the same)
        for name, p in model.named_parameters():
            if "projector" in name and p.dim() > 1 and not p.any():
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    small = AutoProcessor.from_pretrained(tiny)
    side = sizes["vision_config"]["image_size"]
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side}),
        tokenizer=small.tokenizer,
        chat_template=small.chat_template,
        image_seq_length=sizes["mm_tokens_per_image"],
    )
    processor.save_pretrained(folder)
    shutil.copy(tiny / "generation_config.json", folder / "generation_config.json")
    return folder


COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPE_NAMES = ("circle", "square", "triangle")
QUESTIONS = ("What is in this picture?", "Describe the image.", "What shape do you see, and what colour is it?")


def draw(path: Path, shape: str, colour: str, ground: str, side: int, rng: random.Random) -> None:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), COLOURS[ground])
    pen = ImageDraw.Draw(image)
    size = rng.randint(side // 3, side - side // 8)
    x, y = rng.randint(0, side - size), rng.randint(0, side - size)
    if shape == "circle":
        pen.ellipse((x, y, x + size, y + size), fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle((x, y, x + size, y + size), fill=COLOURS[colour])
    else:
        pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=COLOURS[colour])
    image.save(path)


def write_data(folder: Path, n: int, side: int, seed: int, median_words: int, max_words: int) -> Path:
    """n chat rows with one drawn image each (typed image parts, paths relative to the file)."""
    rng = random.Random(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        shape, colour = rng.choice(SHAPE_NAMES), rng.choice(list(COLOURS))
        ground = rng.choice([c for c in COLOURS if c != colour])
        draw(folder / "img" / f"{i}.png", shape, colour, ground, side, rng)
        extra = min(max_words, max(2, int(rng.lognormvariate(math.log(median_words), 0.7))))
        answer = f"A {colour} {shape} on a {ground} ground. " + " ".join(rng.choice(WORDS) for _ in range(extra))
        user = [{"type": "image", "image": f"img/{i}.png"}, {"type": "text", "text": rng.choice(QUESTIONS)}]
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def summarise(repeats: list[dict]) -> dict:
    summary = {**repeats[0], "repeats": repeats}
    for key in ("wall", "train_seconds", "peak"):
        summary[key] = median([r[key] for r in repeats])
    summary["startup"] = median([r["wall"] - r["train_seconds"] for r in repeats])
    summary["median_step"] = median([median(r["step_seconds"][1:] or r["step_seconds"]) for r in repeats])
    return summary


def table(results: dict, setup: str) -> str:
    lines = [
        setup,
        "",
        "| route | wall s | training s | start-up s | real tokens/s (training) | median step s | peak RSS MiB | LoRA parameters "
        "| final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        final = sum(r["losses"][-5:]) / len(r["losses"][-5:])
        lines.append(
            f"| {name} | {r['wall']:.1f} | {r['train_seconds']:.1f} | {r['startup']:.1f} | {r['tokens'] / r['train_seconds']:,.0f} | "
            f"{r['median_step']:.2f} | {r['peak'] / 2**20:,.0f} | {r['trainable']:,} | {final:.4f} |"
        )
    ours, trl = results["lora-tune train"], results["TRL SFTTrainer"]
    lines += [
        "",
        f"lora-tune vs TRL SFTTrainer: speed {trl['wall'] / ours['wall']:.2f}x (whole process), "
        f"{trl['train_seconds'] / ours['train_seconds']:.2f}x (training), "
        f"{trl['median_step'] / ours['median_step']:.2f}x (median step); peak RSS {ours['peak'] / trl['peak']:.2f}x",
    ]
    if len(ours["repeats"]) > 1:
        pairs = list(zip(ours["repeats"], trl["repeats"], strict=True))
        lines.append(
            "  each repeat: whole process "
            + " ".join(f"{b['wall'] / a['wall']:.2f}x" for a, b in pairs)
            + ", training "
            + " ".join(f"{b['train_seconds'] / a['train_seconds']:.2f}x" for a, b in pairs)
            + ", peak RSS "
            + " ".join(f"{a['peak'] / b['peak']:.2f}x" for a, b in pairs)
        )
    lines.append(
        f"tokens trained on: lora-tune {ours['tokens']:,}, TRL {trl['tokens']:,} (real, image tokens included); TRL's batches "
        f"{trl['padded_tokens']:,} positions ({1 - trl['tokens'] / trl['padded_tokens']:.0%} padding), {trl['label_tokens']:,} with a loss"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=48, help="image-text rows (one epoch: rows / 2 optimizer steps)")
    parser.add_argument("--repeats", type=int, default=None, help="both routes N times, round robin; medians (default 3; --tiny 1)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tiny", action="store_true", help="the tiny Gemma 3 and 4 rows, 2 steps (for the test suite)")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--markdown", default=None, help="write the table to this Markdown file")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.tiny else 3)
    shape = "tiny" if args.tiny else "cpu"
    rows = 4 if args.tiny else args.rows
    side = 64 if args.tiny else SHAPES["cpu"]["vision_config"]["image_size"]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vlm-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    base = build_model(work / f"gemma3-{shape}", shape)
    cfg = {
        "micro_batch_size": 2,
        "max_seq_len": 512,
        "seed": 42,
        "rank": 8,
        "lr": 2e-4,
        "targets": TARGETS,
        "max_steps": rows // 2,
    }
    # ~3 tokens a word with the tiny tokenizer; the image, question and template take < 100: every row fits
    data = write_data(work / "data", rows, side, seed=0, median_words=8 if args.tiny else 45, max_words=(cfg["max_seq_len"] - 100) * 2 // 7)
    runs: dict[str, list[dict]] = {name: [] for name in ROUTES}
    for _ in range(args.repeats):  # round robin: a slow spell of the machine hits both routes alike
        for name, script in ROUTES.items():
            out = work / "".join(c if c.isalnum() else "_" for c in name)
            shutil.rmtree(out, ignore_errors=True)
            runs[name].append(run_route(script, base, data, cfg, out, preloaded=args.tiny))
    results = {name: summarise(repeats) for name, repeats in runs.items()}
    ours, trl = results["lora-tune train"], results["TRL SFTTrainer"]
    if ours["trainable"] != trl["trainable"] or ours["steps"] != trl["steps"]:
        raise SystemExit(
            f"not the same run: LoRA parameters {ours['trainable']} vs {trl['trainable']}, steps {ours['steps']} vs {trl['steps']}"
        )
    config = json.loads((base / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    setup = (
        f"{rows} image-text rows (one {vision['image_size']}-pixel image each, {config['mm_tokens_per_image']} image tokens), "
        f"Gemma 3 ({shape}: language model hidden {text['hidden_size']}, {text['num_hidden_layers']} layers, vocabulary "
        f"{text['vocab_size']:,}; vision tower hidden {vision['hidden_size']}, {vision['num_hidden_layers']} layers, frozen) fp32, "
        f"LoRA r{cfg['rank']} alpha {2 * cfg['rank']} on q k v o gate up down of the language model, AdamW lr {cfg['lr']} cosine, "
        f"micro-batch {cfg['micro_batch_size']} padded rows, max length {cfg['max_seq_len']}, {cfg['max_steps']} steps"
        + (f"; medians of {args.repeats} repeats" if args.repeats > 1 else "")
    )
    text_out = table(results, setup)
    print(text_out)
    if args.markdown:
        import peft
        import torch
        import transformers
        import trl

        Path(args.markdown).write_text(
            "# Image-text LoRA: lora-tune vs TRL SFTTrainer (python benchmarks/vlm_vs_trl.py)\n\n"
            f"{time.strftime('%Y-%m-%d')}, {platform.machine()} CPU, 2 cores (shared); TRL {trl.__version__}, "
            f"peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}.\n\n" + text_out + "\n"
        )
    if args.json:
        summary = {"setup": setup, "config": cfg, "shape": shape, "rows": rows, "results": results}
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
