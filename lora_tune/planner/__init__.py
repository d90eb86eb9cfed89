"""`lora-tune plan`: will a fine-tune fit, and which setup that fits is fastest.

Everything is computed from config.json alone (shipped for aliases), never from weights. One module
per step: `architecture` (shapes from a meta skeleton), `memory` (bytes per device and host; the
backends say how states are split and offloaded), `vision` (an image-text model's tower and images),
`speed` (relative throughput), `search` (`--auto`), `hardware` (GPU names and sizes) and `render`
(tables, commands, advice).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from lora_tune.engines import registry as engines
from lora_tune.planner import render
from lora_tune.planner.architecture import load_architecture
from lora_tune.planner.hardware import cpu_memory_bytes, gpu_memory_bytes
from lora_tune.planner.memory import Estimate, estimate, setup_from, with_adapter
from lora_tune.planner.records import Setup
from lora_tune.planner.search import (
    CONTEXT_STEP,
    at_length,
    fewest_checkpointed,
    fits,
    longest_context,
    memory_budget,
    search,
    split_degrees,
)
from lora_tune.planner.speed import relative_speed
from lora_tune.training import compilation


@dataclass(frozen=True)
class Plan:
    """What `lora-tune plan` computes: the numbers of `--json`, and the table it prints."""

    estimate: Estimate
    fits: bool
    setup: Setup
    auto: bool  # a search (--auto) rather than one setup
    recommended: dict | None  # --auto: the fastest setup that fits and its train command (None: nothing fits)
    text: str

    @property
    def trainable_parameters(self) -> int:
        return self.estimate.trainable_parameters

    @property
    def per_device(self) -> dict[str, int]:
        return self.estimate.per_device

    @property
    def host(self) -> dict[str, int]:
        return self.estimate.host

    def to_json(self) -> dict:
        out = {"trainable_parameters": self.trainable_parameters, "per_device": self.per_device, "host": self.host, "fits": self.fits}
        return {**out, "recommended": self.recommended} if self.auto else out


def compute(cfg) -> Plan:
    # Planning a cell `train` refuses would answer a question nobody can run: same matrix.
    engines.check_compatibility(cfg, paths=False)
    compilation.check_cell(cfg, engines.spec_of(cfg))
    arch = load_architecture(cfg.base)
    setup = with_adapter(cfg, arch, setup_from(cfg))
    if not cfg.auto:  # --auto searches the cells and degrees train accepts (search.py)
        engines.check_layer_by_layer(cfg, arch.quantized)
        engines.check_sequence_parallel(cfg, arch.config, setup.world)
    gpu_bytes = gpu_memory_bytes(cfg.gpu_memory)
    cpu_bytes = cpu_memory_bytes(cfg.cpu_memory)
    recommended = None
    if cfg.max_context:
        return context_plan(cfg, arch, setup, gpu_bytes, cpu_bytes)
    if cfg.auto:
        best, est, nearest = search(arch, setup, gpu_bytes, cpu_bytes)
        if best is None:
            setup, est = nearest
            text = "nothing fits; the nearest option:\n" + render.table(est, setup, gpu_bytes, cpu_bytes, arch.layers)
        else:
            setup, command = best, render.train_command(cfg.base, best, cfg.data, cfg.output_dir)
            recommended = asdict(best) | {"command": command}
            table = render.table(est, best, gpu_bytes, cpu_bytes, arch.layers)
            text = f"fastest setup that fits (relative speed {relative_speed(best, arch.layers):.2f}):\n{table}\n\n{command}"
    else:
        if cfg.gradient_checkpointing == "auto":  # what train would choose on this GPU
            setup = fewest_checkpointed(arch, setup, memory_budget(cfg.memory_budget, gpu_bytes)[0])
        est = estimate(arch, setup)
        text = render.table(est, setup, gpu_bytes, cpu_bytes, arch.layers)
    for note in (render.quantization_note(arch, setup.precision), render.recurrent_note(arch), render.vision_note(arch, setup)):
        text = f"{text}\n{note}" if note else text
    return Plan(est, fits(est, gpu_bytes, cpu_bytes), setup, bool(cfg.auto), recommended, text)


def context_plan(cfg, arch, setup: Setup, gpu_bytes: int, cpu_bytes: int | None) -> Plan:
    """`plan --max-context`: the longest rows that fit this setup; with --auto, over every
    --sequence-parallel degree the ranks allow."""
    degrees = split_degrees(arch, setup, engines.spec_of(cfg)) if cfg.auto else [setup.sequence_parallel]
    tiled = cfg.tiled_mlp != "off"
    found = [s for n in degrees if (s := longest_context(arch, replace(setup, sequence_parallel=n), gpu_bytes, cpu_bytes, tiled))]
    if not found:
        text = f"not even {CONTEXT_STEP * setup.sequence_parallel} tokens per row fit; see `lora-tune plan` for what takes the memory"
        est = estimate(arch, at_length(arch, setup, CONTEXT_STEP * setup.sequence_parallel, tiled))
        return Plan(est, False, setup, bool(cfg.auto), None, text)
    best = max(found, key=lambda s: (s.max_seq_len, -s.sequence_parallel))
    est = estimate(arch, best)
    command = render.train_command(cfg.base, best, cfg.data, cfg.output_dir)
    table = render.table(est, best, gpu_bytes, cpu_bytes, arch.layers)
    text = f"longest --max-seq-len that fits: {best.max_seq_len:,} tokens\n{table}\n\n{command}"
    recommended = asdict(best) | {"command": command, "max_context": best.max_seq_len}
    return Plan(est, True, best, True, recommended, text)


def run(cfg) -> int:
    """The `lora-tune plan` command; prints a table (or JSON) and returns the exit code."""
    result = compute(cfg)
    print(json.dumps(result.to_json()) if cfg.print_json else result.text)
    return 0
