"""The memory plan of the run about to start: the split --gradient-checkpointing auto chooses, whether
--tiled-mlp auto tiles, and a warning (with --strict-memory, an error) when the plan does not fit the
device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from lora_tune.errors import UserError
from lora_tune.models.adapter import Checkpointing
from lora_tune.models.tiled_mlp import tile_count
from lora_tune.planner import render
from lora_tune.planner.architecture import load_architecture
from lora_tune.planner.memory import GIB, estimate, recomputed_layers, setup_from, with_adapter
from lora_tune.planner.records import Setup
from lora_tune.planner.search import fewest_checkpointed, memory_budget
from lora_tune.planner.speed import checkpointing_cost

if TYPE_CHECKING:
    from lora_tune.config import TrainConfig

log = logging.getLogger("lora_tune")


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of this run: which layers recompute, and what an out-of-memory stop prints."""

    checkpointing: Checkpointing
    out_of_memory_advice: tuple[str, ...]  # the plan's table, then what to change, in that order
    mlp_tiles: int = 0  # --tiled-mlp: tiles per decoder layer's MLP; 0: untiled


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU runs live in host RAM


def run_budget(cfg: TrainConfig, device: torch.device) -> tuple[int, str] | None:
    """search.memory_budget for the device this run trains on (None on a CPU without --memory-budget)."""
    return memory_budget(cfg.memory_budget, device_memory_bytes(device) if device.type == "cuda" else None)


def auto_tiling(cfg: TrainConfig, arch, setup: Setup, device: torch.device) -> Setup:
    """--tiled-mlp: on tiles every MLP; auto tiles when the plan with every layer checkpointed exceeds
    the budget (--memory-budget, the GPU's memory less 10%, a CPU's RAM) and tiling lowers it: tiles
    cost one more MLP forward per step, so they are for rows that don't fit otherwise."""
    tiles = tile_count(setup.row_tokens, arch.hidden)
    if cfg.tiled_mlp == "off" or tiles == 1 or arch.experts:
        if cfg.tiled_mlp == "on":
            why = "a mixture of experts routes tokens" if arch.experts else f"a row's {setup.row_tokens:,} tokens per rank make one tile"
            log.info("--tiled-mlp on: MLPs untiled (%s)", why)
        return setup
    tiled = replace(setup, mlp_tiles=tiles)
    why = "--tiled-mlp on"
    if cfg.tiled_mlp == "auto":
        budget, _ = run_budget(cfg, device) or (device_memory_bytes(device), "a CPU's RAM")
        every_layer = replace(setup, gradient_checkpointing=True, kept_layers=0)
        untiled_need = estimate(arch, every_layer).per_device["total_bytes"]
        tiled_need = estimate(arch, replace(every_layer, mlp_tiles=tiles)).per_device["total_bytes"]
        if untiled_need <= budget or tiled_need >= untiled_need:
            return setup
        why = (
            f"auto: with every layer checkpointed the plan needs {untiled_need / GIB:.2f} GiB untiled, {tiled_need / GIB:.2f} GiB "
            f"tiled, budget {budget / GIB:.2f} GiB"
        )
    log.info("tiled MLP: %d tiles per row of %s tokens per rank (%s)", tiles, f"{setup.row_tokens:,}", why)
    return tiled


def auto_checkpointing(cfg: TrainConfig, arch, setup: Setup, device: torch.device) -> Setup:
    """--gradient-checkpointing auto: the fewest checkpointed layers whose plan fits the budget
    (--memory-budget, else the GPU's memory less 10%). A CPU has no device budget: the fewest whose
    plan needs no more than checkpointing every layer (the last layer keeps its activations: backward
    reaches it first, and rebuilding it would take the same memory)."""
    found = run_budget(cfg, device)
    if found is None:
        every_layer = estimate(arch, replace(setup, gradient_checkpointing=True, kept_layers=0)).per_device["total_bytes"]
        found = (
            every_layer,
            f"the {every_layer / GIB:.2f} GiB of checkpointing every layer: no device memory budget on {device}, --memory-budget sets one",
        )
    budget, source = found
    chosen = fewest_checkpointed(arch, setup, budget)
    need = estimate(arch, chosen).per_device["total_bytes"] / GIB
    recomputed = recomputed_layers(arch, chosen)
    gain = 1 - checkpointing_cost(chosen, arch.layers) / checkpointing_cost(setup, arch.layers)
    log.info(
        "gradient checkpointing (auto): %d of %d decoder layers recomputed, the rest keep their activations (plan %.2f GiB "
        "within %s; step time %.0f%% below checkpointing every layer)",
        recomputed,
        arch.layers,
        need,
        source,
        100 * gain,
    )
    return chosen


def memory_plan(
    cfg: TrainConfig, device: torch.device, pass_tokens: int | None = None, attention: str | None = None, targets=None
) -> MemoryPlan | None:
    """The memory plan for this run, before loading: a warning (or with --strict-memory an error)
    when it will not fit. None when the architecture can't be read offline. `pass_tokens` and
    `attention`: a CPU's passes per micro-batch and the attention implementation
    (lora_tune.training.inputs.SpeedLevers); `targets`: the run's LoRA targets (an adapter that is
    not a uniform LoRA is counted by peft on them)."""
    try:
        arch = load_architecture(cfg.base)
    except UserError as e:
        log.info("memory plan skipped: %s", e)
        return None
    setup = with_adapter(cfg, arch, replace(setup_from(cfg, attention), pass_tokens=pass_tokens), targets)
    setup = auto_tiling(cfg, arch, setup, device)
    if cfg.gradient_checkpointing == "auto":
        setup = auto_checkpointing(cfg, arch, setup, device)
    planned = estimate(arch, setup)
    need, have = planned.per_device["total_bytes"], device_memory_bytes(device)
    log.info("memory plan: %.2f GiB of %.2f GiB on %s", need / GIB, have / GIB, device)
    if arch.vision is not None:
        log.info("memory plan, %s", render.vision_note(arch, setup).removeprefix("note: "))
    if need > have:
        message = (
            f"the memory plan needs {need / GIB:.1f} GiB but {device} has {have / GIB:.1f} GiB; "
            "run `lora-tune plan --auto` with these options for a setup that fits"
        )
        if cfg.strict_memory:
            raise UserError(f"--strict-memory: {message}")
        log.warning("warning: %s", message)
    advice = (render.table(planned, setup, have, None), "try, in this order: " + "; ".join(render.OOM_ADVICE))
    return MemoryPlan(Checkpointing(setup.gradient_checkpointing, setup.kept_layers), advice, setup.mlp_tiles)
