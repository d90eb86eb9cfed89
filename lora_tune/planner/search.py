"""`plan --auto`: every setup `train` runs for this model and hardware, the fastest that fits."""

from __future__ import annotations

from dataclasses import replace

from lora_tune import engines
from lora_tune.planner.architecture import Architecture
from lora_tune.planner.memory import Estimate, Setup, estimate
from lora_tune.planner.speed import relative_speed

SEARCHED_PRECISIONS = ("bf16", "8bit", "4bit")  # fp32 and fp16 are never the fastest fitting choice
MICRO_BATCHES = (1, 2, 4, 8, 16)


def candidates(base: Setup, arch: Architecture):
    """Setups `train` runs (the backends' compatibility cells, and for this model), so the
    recommended command is exact."""
    cells = [
        c
        for c in engines.supported_cells()
        if c.precision in SEARCHED_PRECISIONS and engines.layer_by_layer_refusal(c, arch.quantized) is None
    ]
    for cell in cells:
        if base.world > 1 and not cell.spec.multi_process:
            continue  # one process can't use several GPUs
        if base.world == 1 and cell.spec.multi_process and cell.offload == "none":
            continue  # sharding over one GPU only matters with offload
        for ckpt, act_offload in ((False, False), (True, False), (True, True)):
            for mbs in MICRO_BATCHES:
                yield replace(
                    base,
                    precision=cell.precision,
                    backend=cell.backend,
                    zero=cell.zero,
                    offload=cell.offload,
                    gradient_checkpointing=ckpt,
                    activation_offload=act_offload,
                    micro_batch_size=mbs,
                )


def fits(est: Estimate, gpu_bytes: int, cpu_bytes: int | None) -> bool:
    return est.per_device["total_bytes"] <= gpu_bytes and (cpu_bytes is None or est.host["total_bytes"] <= cpu_bytes)


def search(arch: Architecture, base: Setup, gpu_bytes: int, cpu_bytes: int | None):
    """(best fitting setup or None, its estimate, nearest (setup, estimate) when none fits)."""
    scored = [(s, estimate(arch, s)) for s in candidates(base, arch)]
    fitting = [(s, e) for s, e in scored if fits(e, gpu_bytes, cpu_bytes)]
    if fitting:
        best = max(fitting, key=lambda se: (relative_speed(se[0]), -se[1].per_device["total_bytes"]))
        return best[0], best[1], None
    nearest = min(scored, key=lambda se: se[1].per_device["total_bytes"])
    return None, None, nearest
