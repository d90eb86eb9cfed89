"""Print the README's plan tables: the seed's memory ladders and the published anchors, as
`lora-tune plan` computes them (LoRA rank 16 on all linear layers unless noted).

    python benchmarks/plan_tables.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from lora_tune.planner import architecture, hardware
from lora_tune.planner import memory as plan

# A Llama-shaped ~2B model (the seed's ladder is for "a 2B model"; no alias, so a config.json).
TWO_B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def row(label: str, arch, setup: plan.Setup, gpu: str, published: str) -> str:
    est = plan.estimate(arch, setup)
    total = est.per_device["total_bytes"] / plan.GIB
    fits = "yes" if est.per_device["total_bytes"] <= hardware.gpu_memory_bytes(gpu) else "no"
    return f"| {label} | {total:.1f} GiB | {fits} | {published} |"


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TWO_B))
    two_b, l70, l8 = (
        architecture.load_architecture(str(folder)),
        architecture.load_architecture("llama-70b"),
        architecture.load_architecture("llama-8b"),
    )
    print(f"2B Llama-shaped ({two_b.total / 1e9:.2f}B params), micro-batch 8 x 1024, A100-80 (seed: full fine-tuning, ours: LoRA r16)")
    print("| setup | plan per GPU | fits | seed (full FT) |\n|---|---|---|---|")
    base = plan.Setup(micro_batch_size=8, max_seq_len=1024, optim="adamw")
    print(
        row(
            "fp32, no checkpointing",
            two_b,
            plan.Setup(**{**base.__dict__, "precision": "fp32", "gradient_checkpointing": False}),
            "a100-80",
            "78.5 GB",
        )
    )
    print(row("bf16 (mixed precision)", two_b, plan.Setup(**{**base.__dict__, "gradient_checkpointing": False}), "a100-80", "42.3 GB"))
    print(row("bf16 + checkpointing", two_b, plan.Setup(**{**base.__dict__}), "a100-80", "28.7 GB"))
    print(
        row(
            "bf16 + checkpointing + ZeRO-2 (8 GPUs)",
            two_b,
            plan.Setup(**{**base.__dict__, "backend": "deepspeed", "zero": 2, "gpus": 8}),
            "a100-80",
            "15.2 GB",
        )
    )
    print()
    print("Anchors (batch and sequence as published)")
    print("| setup | plan per GPU | fits | published |\n|---|---|---|---|")
    print(
        row(
            "Llama-3.1-70B bf16, ZeRO-3 + checkpointing, 8x A100-80, mb 1 x 2048",
            l70,
            plan.Setup(backend="deepspeed", zero=3, gpus=8),
            "a100-80",
            "seed: 24 GB/GPU (fp16 full FT); torchtune LoRA: 27.6 GiB/GPU",
        )
    )
    print(
        row(
            "Llama-3.1-70B QLoRA r32, mb 1 x 2048, one GPU",
            l70,
            plan.Setup(precision="4bit", rank=32),
            "a100-80",
            "Unsloth: 41 GB (their offloaded checkpointing, chunked loss)",
        )
    )
    print(
        row(
            "Llama-3.1-70B QLoRA r32, mb 1 x 2048, one GPU, activation offload",
            l70,
            plan.Setup(precision="4bit", rank=32, activation_offload=True),
            "a100-80",
            "Unsloth: 41 GB",
        )
    )
    l2_70 = architecture.load_architecture("llama2-70b")
    print(
        row(
            "Llama-2-70B QLoRA, FSDP2 + CPU offload, 2x RTX 4090, mb 2 x 2048",
            l2_70,
            plan.Setup(precision="4bit", backend="fsdp", offload="cpu", gpus=2, micro_batch_size=2),
            "rtx4090",
            "Answer.AI FSDP+QLoRA: 14.9 GiB peak; peft docs: 19.6 GB",
        )
    )
    print(row("Llama-3.1-8B LoRA bf16, mb 2 x 2048 packed, RTX 4090", l8, plan.Setup(micro_batch_size=2), "rtx4090", "torchtune: 16.2 GiB"))
    print(
        row(
            "Llama-3.1-8B LoRA bf16, same, full logits (--loss-chunk-size 0)",
            l8,
            plan.Setup(micro_batch_size=2, loss_chunk_size=0),
            "rtx4090",
            "torchtune: 16.2 GiB (chunked loss)",
        )
    )
    print(
        row(
            "Llama-3.1-8B QLoRA, mb 2 x 2048 packed, RTX 4090",
            l8,
            plan.Setup(precision="4bit", micro_batch_size=2),
            "rtx4090",
            "torchtune: 7.4 GiB",
        )
    )


if __name__ == "__main__":
    main()
