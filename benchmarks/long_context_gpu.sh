#!/usr/bin/env bash
# One GPU, random weights, no downloads: Llama-3-8B-shaped QLoRA (4-bit, LoRA r16) on rows of 65,536
# and 131,072 tokens, every layer checkpointed, with and without --tiled-mlp: tokens/s and peak
# max_memory_allocated (benchmarks/train_vs_peers.py's routes). Results: benchmarks/results/long_context_gpu.md
# (and .jsonl). Sequence parallelism needs several GPUs: with N of them, the same script's command
# lines take --nproc N --backend fsdp --sequence-parallel N (see the README). About 10 minutes on one H200.
#
#   bash benchmarks/long_context_gpu.sh                        # on a GPU
#   LONG_CONTEXT_TINY=1 bash benchmarks/long_context_gpu.sh    # the same script on a tiny shape (the test suite, on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
shape=8b; steps=3; seqs="65536 131072"; out=benchmarks/results/long_context_gpu
if [ -n "${LONG_CONTEXT_TINY:-}" ]; then shape=tiny; steps=2; seqs="1024"; out="${LONG_CONTEXT_OUT:-$(mktemp -d)/long_context_gpu}"; fi
work="${LONG_CONTEXT_WORK:-$(mktemp -d)}"; mkdir -p "$work"
routes=("lora-tune train --gradient-checkpointing on --tiled-mlp off" "lora-tune train --gradient-checkpointing on --tiled-mlp on")
rm -f "$out.jsonl"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU (CPU run)"
  for seq in $seqs; do
    python benchmarks/train_vs_peers.py --shape "$shape" --precision 4bit --seq "$seq" --micro-batch 1 --max-steps "$steps" \
      --samples 8 --cases equal-length --routes "${routes[@]}" --workdir "$work" --json "$out.jsonl" 2>"$work/stderr.log" \
      || { tail -n 30 "$work/stderr.log" >&2; exit 1; }  # third-party noise stays out of the table, failures don't
    echo
  done
} | tee "$out.md"
