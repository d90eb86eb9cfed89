"""Agentic GRPO side by side: `lora-tune train --objective grpo --tools` vs TRL 1.16's
`GRPOTrainer(tools=[...])`, the calculator task, same model, prompts, tool, rewards, LoRA, group
size, completion budget, tool-call limit, batch and steps; transformers generation on both.

Model: the tiny Llama with Qwen2.5's tool template, every weight fine-tuned on 64 demonstrations of
the calculator (lora_tune.models.tiny.agent: a model that has seen the call format, what agentic RL
starts from), built once before the timers. Prompts: examples/data/arithmetic.jsonl (32 questions
with their answer). Tool: examples/tools.py:calculator. Rewards: examples/rewards.py's `correct`
(the last number is the answer), `grounded` (the answer repeats the tool's result) and `tool_ok` (a
call was made and none failed: the dense signal a tiny model learns from in 30 steps). LoRA r16 /
alpha 32 / dropout 0 on every linear layer; G = 4 completions per prompt of up to 96 tokens in all
(tool results included: TRL's max_completion_length, lora-tune's --max-new-tokens), temperature
0.7, at most 2 tool calls; a step trains 2 prompts x 4 completions (batch 4, accumulation 2); loss
dapo, beta 0; lr 1e-3 (at 1e-2 both routes collapse); fp32, no checkpointing (the model is tiny).

Each route runs in a fresh interpreter; reported: whole-process wall time (imports and model loading
included), peak RSS (VmHWM), the mean reward over the first and last steps, the tool calls per
completion, and the share of completion tokens the tools and the template wrote (masked out of the
loss: TRL's tool_mask, lora-tune's labels). Run it on an idle machine.

    python benchmarks/agent_vs_trl.py [--steps 30] [--lr 1e-3] [--workdir DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from peak_rss import PEAK  # benchmarks/ is on sys.path: these run as scripts
from train_vs_peers import run_route

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

TRL_AGENT = (
    PEAK
    + r"""
import json, sys
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
cfg = json.loads(sys.argv[3])
sys.path.insert(0, cfg["examples"])
from rewards import correct, grounded, tool_ok
from tools import calculator
rows = [json.loads(line) for line in open(sys.argv[2])]
tok = AutoTokenizer.from_pretrained(sys.argv[1])
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
masked = []

class Measured(GRPOTrainer):
    # The share of completion tokens TRL's tool_mask leaves out of the loss, per generation batch.
    def _generate(self, prompts):
        out = super()._generate(prompts)
        ids, mask = out[1], out[2]
        masked.append(1 - sum(map(sum, mask)) / sum(map(len, ids)) if mask is not None else 0.0)
        return out

args = GRPOConfig(output_dir=sys.argv[4], per_device_train_batch_size=cfg["micro_batch_size"],
                  gradient_accumulation_steps=cfg["grad_accum"],
                  num_generations=cfg["num_generations"], max_completion_length=cfg["max_new_tokens"], temperature=cfg["temperature"],
                  learning_rate=cfg["lr"], max_steps=cfg["steps"], logging_steps=1, save_strategy="no", report_to="none",
                  max_tool_calling_iterations=cfg["max_tool_calls"], seed=cfg["seed"], disable_tqdm=True,
                  use_cpu=not torch.cuda.is_available(), bf16=False, beta=0.0, loss_type="dapo", use_vllm=False)
peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
trainer = Measured(model=model, reward_funcs=[correct, grounded, tool_ok], args=args, train_dataset=Dataset.from_list(rows),
                   processing_class=tok, peft_config=peft, tools=[calculator])
trainer.train()
logs = [h for h in trainer.state.log_history if "reward" in h]
print("RESULT", json.dumps({"peak": peak(), "rewards": [h["reward"] for h in logs], "calls": [h["tools/call_frequency"] for h in logs],
                            "lengths": [h["completions/mean_length"] for h in logs], "masked": masked}))
"""
)

LORA_TUNE_AGENT = (
    PEAK
    + r"""
import json, sys
import lora_tune
cfg = json.loads(sys.argv[3])
examples = cfg["examples"]
result = lora_tune.train(base=sys.argv[1], data=sys.argv[2], output_dir=sys.argv[4], objective="grpo",
                         reward=[f"{examples}/rewards.py:{name}" for name in ("correct", "grounded", "tool_ok")],
                         tools=f"{examples}/tools.py:calculator",
                         num_generations=cfg["num_generations"], max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
                         max_tool_calls=cfg["max_tool_calls"], micro_batch_size=cfg["micro_batch_size"], grad_accum=cfg["grad_accum"],
                         lr=cfg["lr"], max_steps=cfg["steps"], precision="fp32", rank=16, alpha=32, dropout=0.0, optim="adamw",
                         seed=cfg["seed"], max_seq_len=512, gradient_checkpointing="off", data_cache=False, logging_steps=1)
steps = [r for r in result.metrics if "reward" in r]
print("RESULT", json.dumps({"peak": peak(), "rewards": [r["reward"] for r in steps], "calls": [r["tools/call_frequency"] for r in steps],
                            "lengths": [r["completions/mean_length"] for r in steps],
                            "masked": [r["tools/masked_token_share"] for r in steps]}))
"""
)

OURS = "lora-tune train --objective grpo --tools"
TRL = "TRL GRPOTrainer(tools=[...])"
ROUTES = {OURS: LORA_TUNE_AGENT, TRL: TRL_AGENT}


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3, help="both routes' learning rate")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tiny", action="store_true", help="a model primed for 30 steps, 3 steps of each route (for the test suite)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="agent-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    from lora_tune.models.tiny.agent import build_tiny_agent

    prime = 30 if args.tiny else 150
    base = work / f"agent-{prime}"
    if not (base / "config.json").exists():
        build_tiny_agent(base, EXAMPLES / "data" / "arithmetic_demos.jsonl", steps=prime)
    steps = 3 if args.tiny else args.steps
    cfg = {
        "num_generations": 4,
        "micro_batch_size": 4,
        "grad_accum": 2,
        "max_new_tokens": 96,
        "max_tool_calls": 2,
        "temperature": 0.7,
        "steps": steps,
        "lr": args.lr,
        "seed": 42,
        "examples": str(EXAMPLES),
    }
    results = {}
    for name, script in ROUTES.items():
        out = work / "".join(c if c.isalnum() else "_" for c in name)
        shutil.rmtree(out, ignore_errors=True)
        results[name] = run_route(script, base, EXAMPLES / "data" / "arithmetic.jsonl", cfg, out, args.tiny)
    window = max(1, min(5, steps // 3))
    print(
        f"tiny tool-calling Llama (Qwen2.5 template, primed {prime} steps), fp32, LoRA r16 all-linear, {steps} steps of 2 prompts x "
        f"{cfg['num_generations']} completions of up to {cfg['max_new_tokens']} tokens, <= {cfg['max_tool_calls']} calculator calls; "
        "rewards: correct + grounded + tool_ok"
    )
    print(
        f"| route | wall s | s / step | peak RSS MiB | mean reward, first {window} steps | last {window} steps | "
        "tool calls per completion | completion tokens masked |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        first, last = mean(r["rewards"][:window]), mean(r["rewards"][-window:])
        print(
            f"| {name} | {r['wall']:.1f} | {r['wall'] / steps:.2f} | {r['peak'] / 2**20:,.0f} | {first:.3f} | {last:.3f} | "
            f"{mean(r['calls']):.2f} | {100 * mean(r['masked']):.1f}% |"
        )
    print("\nreward per step:")
    for name, r in results.items():
        print(f"{name}: " + " ".join(f"{x:.2f}" for x in r["rewards"]))
    ours, trl = results[OURS], results[TRL]
    print(f"\n{OURS} vs {TRL}: speed {trl['wall'] / ours['wall']:.2f}x (whole process); peak RSS {ours['peak'] / trl['peak']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
