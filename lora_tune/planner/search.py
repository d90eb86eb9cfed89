"""`plan --auto`: every setup `train` runs for this model and hardware, the fastest that fits."""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from lora_tune.engines import registry as engines
from lora_tune.models import sequence_parallel
from lora_tune.models.tiled_mlp import tile_count
from lora_tune.planner.architecture import Architecture
from lora_tune.planner.memory import GIB, Estimate, estimate
from lora_tune.planner.records import Setup
from lora_tune.planner.speed import relative_speed

SEARCHED_PRECISIONS = ("bf16", "8bit", "4bit")  # fp32 and fp16 are never the fastest fitting choice
MICRO_BATCHES = (1, 2, 4, 8, 16)


def candidates(base: Setup, arch: Architecture, gpu_bytes: int):
    """Setups `train` runs (the backends' compatibility cells, and for this model), so the
    recommended command is exact."""
    cells = [
        c
        for c in engines.supported_cells()
        if c.precision in SEARCHED_PRECISIONS and engines.layer_by_layer_refusal(c, arch.quantized) is None
    ]
    # Online RL generates a step's completions at once (rollout_sequences, the user's choice, kept): the
    # micro-batch splits them, so only sizes that divide them give whole steps.
    micro_batches = [m for m in MICRO_BATCHES if not base.rollout_sequences or base.rollout_sequences % m == 0]
    for cell in cells:
        if base.world > 1 and not cell.spec.multi_process:
            continue  # one process can't use several GPUs
        if base.world == 1 and cell.spec.multi_process and cell.offload == "none":
            continue  # sharding over one GPU only matters with offload
        degrees = split_degrees(arch, base, cell.spec)
        for (ckpt, act_offload), mbs, degree in product(((False, False), (True, False), (True, True)), micro_batches, degrees):
            setup = replace(
                base,
                precision=cell.precision,
                backend=cell.backend,
                zero=cell.zero,
                offload=cell.offload,
                gradient_checkpointing=ckpt,
                kept_layers=0,
                activation_offload=act_offload,
                micro_batch_size=mbs,
                sequence_parallel=degree,
                attention=sequence_parallel_attention(base.attention, degree),
            )
            yield setup
            if ckpt and not act_offload:  # what --gradient-checkpointing auto would choose on this GPU
                yield fewest_checkpointed(arch, setup, memory_budget(None, gpu_bytes)[0])


BUDGET_SHARE = 0.9  # --gradient-checkpointing auto plans for the GPU's memory less 10% unless given a budget


def memory_budget(memory_budget_gib: float | None, gpu_bytes: int | None) -> tuple[int, str] | None:
    """The memory the automatic choices (--gradient-checkpointing auto, --tiled-mlp auto) plan a run
    to fit, and where the figure comes from: --memory-budget, else the GPU's memory (`gpu_bytes`) less
    10%; None with neither (a CPU: its RAM is no device budget, each choice says what it does then)."""
    if memory_budget_gib is not None:
        return int(memory_budget_gib * GIB), f"--memory-budget {memory_budget_gib:g} GiB"
    if gpu_bytes is not None:
        return int(BUDGET_SHARE * gpu_bytes), f"{BUDGET_SHARE:.0%} of {gpu_bytes / GIB:.1f} GiB"
    return None


def fewest_checkpointed(arch: Architecture, setup: Setup, budget_bytes: int) -> Setup:
    """The setup with the fewest checkpointed decoder layers whose plan fits the budget (the others
    keep their activations); every layer when even that does not fit; none when all fit."""
    if estimate(arch, replace(setup, gradient_checkpointing=False, kept_layers=0)).per_device["total_bytes"] <= budget_bytes:
        return replace(setup, gradient_checkpointing=False, kept_layers=0)
    # Peak memory grows with every layer kept: the largest number kept that still fits.
    low, high = 0, arch.layers - 1
    while low < high:
        middle = (low + high + 1) // 2
        if estimate(arch, replace(setup, gradient_checkpointing=True, kept_layers=middle)).per_device["total_bytes"] <= budget_bytes:
            low = middle
        else:
            high = middle - 1
    return replace(setup, gradient_checkpointing=True, kept_layers=low)


def fits(est: Estimate, gpu_bytes: int, cpu_bytes: int | None) -> bool:
    return est.per_device["total_bytes"] <= gpu_bytes and (cpu_bytes is None or est.host["total_bytes"] <= cpu_bytes)


def search(arch: Architecture, base: Setup, gpu_bytes: int, cpu_bytes: int | None):
    """(best fitting setup or None, its estimate, nearest (setup, estimate) when none fits)."""
    scored = [(s, estimate(arch, s)) for s in candidates(base, arch, gpu_bytes)]
    fitting = [(s, e) for s, e in scored if fits(e, gpu_bytes, cpu_bytes)]
    if fitting:
        best = max(fitting, key=lambda se: (relative_speed(se[0], arch.layers), -se[1].per_device["total_bytes"]))
        return best[0], best[1], None
    nearest = min(scored, key=lambda se: se[1].per_device["total_bytes"])
    return None, None, nearest


CONTEXT_STEP = 256  # `plan --max-context` answers in multiples of this many tokens per rank of a row


def at_length(arch: Architecture, setup: Setup, tokens: int, tiled: bool) -> Setup:
    """The setup at --max-seq-len `tokens`, every layer checkpointed (what auto chooses at long
    rows), its MLPs tiled when `tiled` (and they are dense)."""
    longer = replace(setup, max_seq_len=tokens, gradient_checkpointing=True, kept_layers=0, mlp_tiles=0)
    if tiled and not arch.experts:
        longer = replace(longer, mlp_tiles=tile_count(longer.row_tokens, arch.hidden))
    return longer


def longest_context(arch: Architecture, setup: Setup, gpu_bytes: int, cpu_bytes: int | None, tiled: bool) -> Setup | None:
    """The setup with the longest --max-seq-len (a multiple of CONTEXT_STEP per rank of the row)
    whose plan fits; None when not even one step's worth does. Memory grows with the length (linearly,
    quadratically where attention builds a mask), so a doubling then a bisection finds it."""
    step = CONTEXT_STEP * setup.sequence_parallel

    def fitting(n: int) -> bool:
        return fits(estimate(arch, at_length(arch, setup, n * step, tiled)), gpu_bytes, cpu_bytes)

    if not fitting(1):
        return None
    low, high = 1, 2
    while fitting(high) and high < 1 << 20:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fitting(middle) else (low, middle)
    return at_length(arch, setup, low * step, tiled)


def split_degrees(arch: Architecture, setup: Setup, spec) -> list[int]:
    """The --sequence-parallel degrees train runs this setup with under the backend `spec`
    (engines.check_sequence_parallel): SFT with the chunked loss, over several processes a backend
    coordinates, and what the model allows; else rows whole (1)."""
    if not (spec.multi_process and setup.objective == "sft" and setup.loss_chunk_size != 0):
        return [1]
    return sequence_parallel_degrees(arch, setup.world)


def sequence_parallel_degrees(arch: Architecture, world: int) -> list[int]:
    """The --sequence-parallel degrees `train` accepts on `world` ranks for this model: divisors of
    the world that the model's own refusal lets through (its heads split evenly, attention it
    reproduces: no sliding windows, text-only)."""
    return [n for n in range(1, world + 1) if world % n == 0 and (n == 1 or sequence_parallel.refusal(arch.config, n) is None)]


def sequence_parallel_attention(attention: str, degree: int) -> str:
    """The attention a setup runs with rows split over `degree` ranks."""
    return sequence_parallel.implementation(attention.removeprefix("ulysses_"), degree)
