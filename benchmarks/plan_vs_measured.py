"""Plan vs measured peak memory for a training step.

CUDA (the real check): a Llama-3-8B-shaped model with random weights in bf16, 8bit and 4bit,
seq 2048, micro-batch 1, with and without gradient checkpointing; one optimizer step each;
measured = torch.cuda.max_memory_allocated, compared with the plan's total minus the CUDA
context (which max_memory_allocated does not see). Goal: within 5%.

CPU (--tiny, to test the script itself): a 2-layer model, measured = bytes autograd saved + model
states, against the same parts of the plan.

    python benchmarks/plan_vs_measured.py            # on a GPU; writes benchmarks/results/plan_vs_measured.json
    python benchmarks/plan_vs_measured.py --tiny     # on CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from lora_tune.config import TrainConfig
from lora_tune.data.batching import collate
from lora_tune.data.prepare import Sample
from lora_tune.engines.single import SingleDeviceEngine
from lora_tune.models.adapter import add_lora
from lora_tune.models.loading import load_base_model
from lora_tune.planner import architecture
from lora_tune.planner import memory as plan
from lora_tune.training.objectives.sft import CausalLMLoss

LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def random_model(folder: Path, config: dict) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})).to(
            torch.bfloat16
        )
    model.save_pretrained(folder, max_shard_size="5GB")
    del model
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return folder


def one_run(base: Path, precision: str, checkpointing: bool, seq: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(
        base=str(base),
        data="d",
        output_dir="o",
        precision=precision,
        rank=16,
        max_seq_len=seq,
        micro_batch_size=1,
        gradient_checkpointing=checkpointing,
        dropout=0.0,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = add_lora(load_base_model(str(base), precision, device), cfg, str(base))
    engine = SingleDeviceEngine(cfg, device)
    engine.prepare(CausalLMLoss(model, cfg.loss_chunk_size), total_steps=2)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (seq,)).tolist()
    batch = collate([[Sample(ids, ids)]], pad_id=0, packed=False)
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward_backward(batch, seq - 1)
    engine.step()
    estimate = plan.estimate(architecture.load_architecture(str(base)), plan.setup_from(cfg))
    result = {
        "precision": precision,
        "checkpointing": checkpointing,
        "seq": seq,
        "plan_total_bytes": estimate.per_device["total_bytes"],
        "plan_saved_bytes": estimate.saved_activations_bytes,
        "measured_saved_bytes_upper": saved,
    }
    if device.type == "cuda":
        measured = torch.cuda.max_memory_allocated(device)
        planned = estimate.per_device["total_bytes"] - plan.CUDA_CONTEXT
        result |= {"measured_peak_bytes": measured, "plan_minus_context_bytes": planned, "ratio": planned / measured}
    del model, engine
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="2-layer model on CPU (tests the script)")
    parser.add_argument("--out", default="benchmarks/results/plan_vs_measured.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    if args.tiny:
        from lora_tune.models.tiny.model import build_tiny_llama

        base, seq, precisions = build_tiny_llama(work / "tiny"), 128, ["bf16", "4bit"]
    else:
        base, seq, precisions = random_model(work / "llama3-8b-random", LLAMA3_8B), 2048, ["bf16", "8bit", "4bit"]
    rows = [one_run(base, p, ckpt, seq) for p in precisions for ckpt in (False, True)]
    for r in rows:
        tail = (
            f" measured peak {r['measured_peak_bytes'] / 2**30:.2f} GiB, plan {r['plan_minus_context_bytes'] / 2**30:.2f} GiB, "
            f"ratio {r['ratio']:.3f}"
            if "ratio" in r
            else ""
        )
        print(f"{r['precision']:>5} ckpt={r['checkpointing']!s:<5} plan total {r['plan_total_bytes'] / 2**30:.3f} GiB{tail}")
    if not args.tiny:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
