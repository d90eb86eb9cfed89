"""Long context on a CPU: the peak activation memory of one training step over one packed row, per
rank, with and without --sequence-parallel 2 and --tiled-mlp, against the plan's figures.

    python benchmarks/long_context.py [--tokens 16384] [--documents 4] [--json OUT.json]

A tiny Llama (4 layers, hidden 64, MLP 224 wide as Llama's 3.5x, one key/value head for 2 ranks:
GQA replicated) trains LoRA r8 on all linears, fp32, every layer checkpointed (the long-context
setting), on one row of `--tokens` tokens holding `--documents` documents (positions restart per
document, as packing makes them), then on one row of one document. A row of several documents gets
a [tokens x tokens] attention mask from transformers in one process (sdpa_packed: built from the
positions, three such grids while it is built); sequence parallelism's attention needs none.
Each configuration measures its second step (the first creates the LoRA gradients) with
`lora_tune.planner.measured.cpu_tensor_peak`: the peak of live tensor bytes allocated during the
step, the CPU's counterpart of CUDA's max_memory_allocated (weights, made before, are not in it).
The 2-rank configurations run under torchrun (gloo), each rank measuring its own step; the figure
is the larger rank's. Prints a table with each configuration's ratio to one process and the plan's
activations + logits for the same setup (planned / measured). `--json` writes the figures.

The GPU counterpart (Llama-3.1-8B at 64k-128k tokens, tokens/s and peak memory with and without)
is `benchmarks/long_context_gpu.sh`, ready for when a device is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

SHAPE = dict(num_hidden_layers=4, num_key_value_heads=1, intermediate_size=224, max_position_embeddings=1 << 20)  # build_tiny_llama's
CONFIGS = [("one process", 1, False), ("one process, --tiled-mlp", 1, True), ("--sequence-parallel 2", 2, False),
           ("--sequence-parallel 2 --tiled-mlp", 2, True)]  # fmt: skip


def row(tokens: int, documents: int) -> dict[str, torch.Tensor]:
    """One packed row: `documents` documents of equal length, each one's first label masked."""
    ids = torch.randint(3, 500, (1, tokens), generator=torch.Generator().manual_seed(0))
    length = tokens // documents
    positions = torch.arange(tokens) % length
    positions[documents * length :] = torch.arange(tokens - documents * length)
    labels = ids.clone()
    labels[0, positions == 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions.unsqueeze(0)}


def measure(base: str, tokens: int, documents: int, sp: int, tiled: bool) -> dict:
    """This rank's peak over one step (the second) of the configuration."""
    from lora_tune.config import TrainConfig
    from lora_tune.data.batching import MicroBatch, shard_rows
    from lora_tune.engines import ranks
    from lora_tune.models.adapter import Checkpointing, add_lora
    from lora_tune.models.loading import load_base_model
    from lora_tune.models.sequence_parallel import implementation
    from lora_tune.models.tiled_mlp import tile_count, tile_mlps
    from lora_tune.planner.architecture import load_architecture
    from lora_tune.planner.measured import cpu_tensor_peak
    from lora_tune.planner.memory import activation_bytes, logits_bytes
    from lora_tune.planner.records import Setup
    from lora_tune.training.objectives.sft import CausalLMLoss

    arch = load_architecture(base)
    tiles = tile_count(-(-tokens // sp), arch.hidden) if tiled else 0
    cfg = TrainConfig(base=base, data="d", output_dir="o", precision="fp32", rank=8, dropout=0.0, sequence_parallel=sp)
    model = load_base_model(base, "fp32", torch.device("cpu"), attn_implementation=implementation("sdpa_packed", sp))
    if tiles:
        tile_mlps(model, tiles)
    loss = CausalLMLoss(add_lora(model, cfg, "b", checkpointing=Checkpointing(True)), None)
    loss.train()
    inputs = row(tokens, documents)
    if sp > 1:
        loss.sequence_group = ranks.sequence_group(sp)
        whole = MicroBatch(inputs, tokens, 0, {}, row_tokens=(tokens,))
        inputs = shard_rows(whole, sp, loss.sequence_group.index, 0).inputs
    labels = int((inputs["shifted_labels" if sp > 1 else "labels"] != -100).sum())
    loss(**inputs, num_items_in_batch=max(labels, 1)).backward()  # the LoRA gradients exist from here on
    with cpu_tensor_peak() as peak:
        loss(**inputs, num_items_in_batch=max(labels, 1)).backward()
    # The all-to-all's buffers, made in the first step and reused: live through the measured one too.
    kept = sum(b.numel() * b.element_size() for pair in (loss.sequence_group.buffers.values() if sp > 1 else ()) for b in pair)
    # One document and no padding: transformers builds no mask (SDPA's causal kernel), so none is planned.
    attention = implementation("sdpa_packed", sp) if documents > 1 else "flash_attention_2"
    setup = Setup(precision="fp32", rank=8, max_seq_len=tokens, gradient_checkpointing=True, sequence_parallel=sp, attention=attention)
    setup = replace(setup, mlp_tiles=tiles)
    planned = activation_bytes(arch, setup)[1] + logits_bytes(arch, setup)[1]
    if sp > 1:
        ranks.release_sequence_groups()
    return {"measured_bytes": peak.bytes + kept, "planned_bytes": planned, "tiles": tiles}


def on_ranks(base: str, tokens: int, documents: int, sp: int, workdir: Path) -> dict[bool, dict]:
    """The configurations on `sp` torchrun ranks (untiled, then tiled, in one job); per configuration
    the larger rank's peak."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = workdir / f"rank-figures-{sp}-{documents}"
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", "--master_addr=127.0.0.1", f"--master_port={port}",
            __file__, "--worker", str(out), "--base", base, "--tokens", str(tokens), "--documents", str(documents)]  # fmt: skip
    argv += ["--sp", str(sp)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    figures = [json.loads((out.parent / f"{out.name}.rank{r}").read_text()) for r in range(sp)]
    return {tiled: max((f[str(tiled)] for f in figures), key=lambda f: f["measured_bytes"]) for tiled in (False, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--base", help="a tiny model folder (default: built in a temporary folder)")
    parser.add_argument("--suite", action="store_true", help="the test suite's check: the packed row only, one process untiled")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one torchrun rank: untiled, then tiled
        torch.distributed.init_process_group("gloo")
        figures = {str(tiled): measure(args.base, args.tokens, args.documents, args.sp, tiled) for tiled in (False, True)}
        torch.distributed.destroy_process_group()
        Path(f"{args.worker}.rank{os.environ['RANK']}").write_text(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        base = args.base
        if base is None:
            from lora_tune.models.tiny.model import build_tiny_llama

            base = str(build_tiny_llama(workdir / "base", **SHAPE))
        results = {}
        layouts = (args.documents,) if args.suite else (args.documents, 1)
        for documents in dict.fromkeys(layouts):  # packed documents, then one long document
            split = on_ranks(base, args.tokens, documents, 2, workdir)
            for name, sp, tiled in CONFIGS:
                key = f"{name}, {documents} document{'s' if documents > 1 else ''}"
                if sp > 1:
                    results[key] = split[tiled]
                elif not (tiled and args.suite):
                    results[key] = measure(base, args.tokens, documents, sp, tiled)
    print(f"one training step over one row of {args.tokens:,} tokens, tiny Llama (hidden 64, MLP 224, 4 layers), fp32, LoRA r8, "
          "every layer checkpointed")  # fmt: skip
    print("| configuration | peak tensor MiB (per rank) | vs one process | planned MiB | planned / measured |")
    print("|---|---|---|---|---|")
    for key, r in results.items():
        documents = key.rsplit(", ", 1)[1]
        one = results[f"one process, {documents}"]["measured_bytes"]
        measured, planned = r["measured_bytes"], r["planned_bytes"]
        print(f"| {key} | {measured / 2**20:.1f} | {measured / one:.2f}x | {planned / 2**20:.1f} | {planned / measured:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "results": results}, indent=1))


if __name__ == "__main__":
    main()
