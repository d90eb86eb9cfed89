"""Side by side, one run: `lora-tune train --objective grpo` vs TRL `GRPOTrainer` (no vLLM: the
policy generates with transformers), same model, prompts, reward, LoRA, group size, completion
length, batch and steps.

Model: Llama-shaped, random fp32 weights, 32,000-row vocabulary (train_vs_peers.py's `cpu` shape),
its matrices scaled 15x (std 0.3 instead of 0.02): at the usual scale the frozen head of a random
model spans logits too narrow (about +-1.3) for any adapter to move what it samples, so no route
could learn a reward.
Prompts, generated: 32 short instructions. Reward: the share of even token ids in the completion (a
dense toy signal a random model can learn in a few steps; TRL passes `completion_ids` as lora-tune
does). LoRA r16 / alpha 32 / dropout 0 on every linear layer of the blocks; non-reentrant gradient
checkpointing; G = 8 completions per prompt of up to 64 tokens, temperature 1; a step trains
2 prompts x 8 completions (TRL: per-device batch 8, gradient accumulation 2; lora-tune: micro-batch
8, grad-accum 2); loss `dapo`, beta 0, one iteration per generation batch (both defaults); lr 2e-2 (`--lr`).

Each route runs in a fresh interpreter; reported: whole-process wall time (imports and model loading
included), peak RSS (VmHWM), and the mean reward over the first and last 5 steps (both routes learn
the reward by a similar margin, or the comparison means nothing). Run it on an idle machine.

    python benchmarks/grpo_vs_trl.py [--steps 30] [--lr 2e-2] [--workdir DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from peak_rss import PEAK  # benchmarks/ is on sys.path: these run as scripts
from train_vs_peers import WORDS, build_model, run_route

REWARD = r"""
def even(prompts, completions, completion_ids, **kwargs):
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
"""

TRL_GRPO = (
    PEAK
    + REWARD
    + r"""
import json, sys
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
cfg = json.loads(sys.argv[3])
rows = [json.loads(line) for line in open(sys.argv[2])]
tok = AutoTokenizer.from_pretrained(sys.argv[1])
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
args = GRPOConfig(output_dir=sys.argv[4], per_device_train_batch_size=cfg["micro_batch_size"], gradient_accumulation_steps=cfg["grad_accum"],
                  num_generations=cfg["num_generations"], max_completion_length=cfg["max_new_tokens"], temperature=1.0,
                  learning_rate=cfg["lr"], max_steps=cfg["steps"], logging_steps=1, save_strategy="no", report_to="none",
                  gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, seed=cfg["seed"],
                  disable_tqdm=True, use_cpu=True, bf16=False, beta=0.0, loss_type="dapo", use_vllm=False)
peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
trainer = GRPOTrainer(model=model, reward_funcs=[even], args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                      peft_config=peft)
trainer.train()
rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
print("RESULT", json.dumps({"peak": peak(), "rewards": rewards, "lengths": lengths}))
"""
)

LORA_TUNE_GRPO = (
    PEAK
    + r"""
import json, sys
from pathlib import Path
import lora_tune
cfg = json.loads(sys.argv[3])
rewards = Path(sys.argv[4]).with_suffix(".rewards.py")
rewards.write_text('''"""
    + REWARD
    + r"""''')
result = lora_tune.train(base=sys.argv[1], data=sys.argv[2], output_dir=sys.argv[4], objective="grpo", reward=f"{rewards}:even",
                         num_generations=cfg["num_generations"], max_new_tokens=cfg["max_new_tokens"], temperature=1.0,
                         micro_batch_size=cfg["micro_batch_size"], grad_accum=cfg["grad_accum"], lr=cfg["lr"], max_steps=cfg["steps"],
                         precision="fp32", rank=16, alpha=32, dropout=0.0, optim="adamw", seed=cfg["seed"], max_seq_len=256,
                         gradient_checkpointing="on", data_cache=False, logging_steps=1)
steps = [r for r in result.metrics if "reward" in r]
print("RESULT", json.dumps({"peak": peak(), "rewards": [r["reward"] for r in steps],
                            "lengths": [r["completions/mean_length"] for r in steps]}))
"""
)

ROUTES = {"lora-tune train --objective grpo": LORA_TUNE_GRPO, "TRL GRPOTrainer (transformers generation)": TRL_GRPO}


def widened(base: Path, folder: Path) -> Path:
    """The model with its matrices scaled 15x (norm weights kept), saved once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return folder
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(15.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": "Write about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + ":"} for _ in range(n)]


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-2, help="both routes' learning rate")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, 4 steps of 16-token completions (for the test suite)")
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "cpu"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = prompts(32, seed=0)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = build_model(work / f"model-{shape}", shape, [r["prompt"] for r in rows] + [" ".join(WORDS)])
    base = widened(base, work / f"model-{shape}-wide")
    cfg = {
        "num_generations": 8,
        "micro_batch_size": 8,
        "grad_accum": 2,
        "max_new_tokens": 16 if args.tiny else 64,
        "steps": 4 if args.tiny else args.steps,
        "lr": args.lr,
        "seed": 42,
    }
    results = {}
    for name in args.routes:
        out = work / "".join(c if c.isalnum() else "_" for c in name)
        shutil.rmtree(out, ignore_errors=True)
        results[name] = run_route(ROUTES[name], base, data, cfg, out, preloaded=args.tiny)
    print(
        f"Llama-shaped ({shape}) fp32 model, LoRA r16 all-linear, checkpointing, {cfg['steps']} steps of 2 prompts x "
        f"{cfg['num_generations']} completions of up to {cfg['max_new_tokens']} tokens, reward: share of even token ids"
    )
    print("| route | wall s | s / step | peak RSS MiB | mean reward, first 5 steps | last 5 steps | mean completion length |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        first, last = mean(r["rewards"][:5]), mean(r["rewards"][-5:])
        print(
            f"| {name} | {r['wall']:.1f} | {r['wall'] / cfg['steps']:.2f} | {r['peak'] / 2**20:,.0f} | {first:.3f} | {last:.3f} | "
            f"{mean(r['lengths']):.1f} |"
        )
    ours = results.get("lora-tune train --objective grpo")
    print()
    for name, r in results.items():
        if ours is not None and r is not ours:
            print(f"lora-tune vs {name}: speed {r['wall'] / ours['wall']:.2f}x (whole process); peak RSS {ours['peak'] / r['peak']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
