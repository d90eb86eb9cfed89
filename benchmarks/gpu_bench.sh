#!/usr/bin/env bash
# One GPU, random weights, no downloads: Llama-3-8B-shaped bf16 LoRA r16 and 4-bit QLoRA at 2,048 and
# 8,192 tokens, lora-tune (eager and --compile, auto and full checkpointing) vs TRL (packing) vs HF Trainer + PEFT: tokens/s, MFU, peak
# max_memory_allocated, and the plan vs what lora-tune measured. Results: benchmarks/results/gpu_bench.md
# (and .jsonl). An estimated 13 minutes on one H200 (8 steps per route, 20 route runs). With VLLM_PYTHON (the python
# of vLLM's environment on that machine) also GRPO with vLLM rollouts vs transformers rollouts vs TRL (grpo_vs_trl.py).
#
#   bash benchmarks/gpu_bench.sh            # on a GPU
#   GPU_BENCH_TINY=1 bash benchmarks/gpu_bench.sh   # the same script on a tiny shape (the test suite, on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
shape=8b; steps=8; seqs="2048 8192"; out=benchmarks/results/gpu_bench
if [ -n "${GPU_BENCH_TINY:-}" ]; then shape=tiny; steps=2; seqs="1024"; out="${GPU_BENCH_OUT:-$(mktemp -d)/gpu_bench}"; fi
work="${GPU_BENCH_WORK:-$(mktemp -d)}"; mkdir -p "$work"
# lora-tune eager and compiled, with auto checkpointing (the default) and with every layer checkpointed.
routes=("lora-tune train (defaults)" "lora-tune train --compile" "lora-tune train --gradient-checkpointing on"
        "lora-tune train --compile --gradient-checkpointing on" "HF Trainer + PEFT (padded)" "TRL SFTTrainer (packing, padding-free)")
rm -f "$out.jsonl"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU (CPU run)"
  for precision in bf16 4bit; do
    for seq in $seqs; do
      python benchmarks/train_vs_peers.py --shape "$shape" --precision "$precision" --seq "$seq" --micro-batch 1 \
        --max-steps "$steps" --samples 64 --cases equal-length --routes "${routes[@]}" --workdir "$work" --json "$out.jsonl" 2>"$work/stderr.log" \
        || { tail -n 30 "$work/stderr.log" >&2; exit 1; }  # third-party noise stays out of the table, failures don't
      echo
    done
  done
  # GRPO with vLLM rollouts (server, colocated) vs transformers rollouts vs TRL, and rollout tokens/s:
  # needs vLLM's own environment on the machine (VLLM_PYTHON=its python; vLLM pins its transformers).
  if [ -z "${GPU_BENCH_TINY:-}" ] && [ -n "${VLLM_PYTHON:-}" ]; then
    python benchmarks/grpo_vs_trl.py --steps 20 --vllm-python "$VLLM_PYTHON" --rollout-speed --workdir "$work/grpo" 2>>"$work/stderr.log" \
      || { tail -n 30 "$work/stderr.log" >&2; exit 1; }
  fi
} | tee "$out.md"
