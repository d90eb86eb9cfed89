"""A tiny model that calls tools: the tiny Llama with Qwen2.5's tool template (build_tiny_llama(tools=True)),
every weight fine-tuned for a few dozen steps on demonstrations (conversations with tool calls), so
that its rollouts call tools from the first step: what agentic RL starts from (a model that has seen
the format), for the tests, the agent notebook and benchmarks/agent_vs_trl.py. A random tiny model
never writes a well-formed call, and a LoRA on its frozen 0.02-scale weights learns the format too
slowly on a CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_tune.models.head import IGNORE
from lora_tune.models.tiny.model import build_tiny_llama


def build_tiny_agent(out_dir: str | Path, demos: Path, steps: int = 60, batch: int = 8, lr: float = 3e-3, seed: int = 0) -> Path:
    """`demos`: a JSONL file of {"messages": [...], "tools": [schemas]} conversations; the model
    learns every assistant turn (tool calls included), never the prompt or the tool results."""
    out = Path(out_dir)
    build_tiny_llama(out / "random", seed=seed, tools=True)
    tokenizer = AutoTokenizer.from_pretrained(out / "random")
    model = AutoModelForCausalLM.from_pretrained(out / "random", dtype=torch.float32)
    rows = [json.loads(line) for line in demos.read_text().splitlines() if line.strip()]
    samples = [demonstration(tokenizer, row["messages"], row.get("tools")) for row in rows]
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        chosen = [samples[(step * batch + i) % len(samples)] for i in range(batch)]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s, _ in chosen])
        labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in chosen])
        mask = (torch.arange(width)[None] < torch.tensor([len(s) for s, _ in chosen])[:, None]).long()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    shutil.copy(out / "random" / "generation_config.json", out / "generation_config.json")
    shutil.rmtree(out / "random")
    return out


def demonstration(tokenizer, messages: list[dict], tools) -> tuple[list[int], list[int]]:
    """(ids, labels): labels on what each assistant turn adds to the conversation before it."""
    ids: list[int] = []
    labels: list[int] = []
    for end in range(1, len(messages) + 1):
        if messages[end - 1]["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[: end - 1], tools=tools, add_generation_prompt=True, return_dict=False)
        turn = tokenizer.apply_chat_template(messages[:end], tools=tools, return_dict=False)
        labels += [IGNORE] * (len(before) - len(ids)) + turn[len(before) :]
        ids = turn
    return ids, labels
