"""The engine seam: everything that differs by backend lives behind one interface.

The recipe (`lora_tune.training.recipe`) loads, trains, checkpoints and saves through `Engine` alone and
never asks which backend runs. Each backend module declares a static `SPEC` (`spec.BackendSpec`:
flags, cells and refusals, loading, memory placement, speed) and implements `Engine`; this module
is the registry that reads the specs for the config's choices, the compatibility matrix, `plan`
and `plan --auto`. Adding a backend = one module with a `SPEC` and an `Engine` + one line in
`BUILTIN` (or `register(spec)` from outside the package).

Backends: `single` (one process, one device), `ddp` (PyTorch DistributedDataParallel: the base whole
on every rank, the adapter's gradients all-reduced), `deepspeed` (ZeRO-1/2/3, optional CPU offload)
and `fsdp` (PyTorch FSDP2, `fully_shard` per decoder layer, optional CPU offload). The DeepSpeed
module imports DeepSpeed only when that backend runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from lora_tune.data.batching import MicroBatch
from lora_tune.engines import ddp, deepspeed, fsdp, single
from lora_tune.engines import ranks as dist
from lora_tune.engines.spec import OFFLOAD_LABEL, OFFLOADS, PRECISIONS, BackendSpec
from lora_tune.errors import UserError
from lora_tune.models import sequence_parallel


class Engine(Protocol):
    """One training backend. Called in this order: `load` -> (`load_adapter`) -> `prepare` ->
    (`load_state`) -> steps -> `adapter_state` / `save_state` at checkpoints.

    A step is exactly `cfg.grad_accum` calls of `forward_backward` followed by one `step()` (or
    `zero_grad()` when the step is dropped): backends that run several processes may count
    micro-batches against it (DeepSpeed marks its accumulation boundary that way). One-process
    backends on a CPU get each micro-batch in passes (lora_tune.data.batching.passes), a call each."""

    spec: ClassVar[BackendSpec]
    # True where an overflowing step is routine and handled (fp16 loss scaling): such a skipped
    # update is not a "bad step".
    skips_overflow: bool

    def load(self, base_path: str, add_adapter: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
        """The base, loaded and partitioned as this backend needs, with the adapter injected by
        `add_adapter` at the moment that suits the backend. Returns what `add_adapter` made: the
        loss module (e.g. `lora_tune.training.objectives.sft.CausalLMLoss`, its peft model as `.peft_model`)."""

    def load_adapter(self, path: Path) -> None:
        """Adapter weights of a checkpoint into the (not yet prepared) model."""

    def prepare(self, model: torch.nn.Module, total_steps: int) -> None:
        """Optimizer, schedule and whatever wrapping the backend needs."""

    def forward_backward(self, batch: MicroBatch, divisor: float) -> torch.Tensor:
        """Backward of this micro-batch's share of the step loss (summed over label tokens, divided
        by `divisor`); returns that share, detached."""

    def step(self) -> tuple[float, bool]:
        """Clip, optimizer and schedule step at the end of an optimizer step: (grad norm, applied)."""

    def zero_grad(self) -> None: ...

    @property
    def lr(self) -> float: ...

    def evaluate(self, batches: list[MicroBatch]) -> tuple[float, int]:
        """(summed token loss, label tokens) over the batches; collective where the backend is."""

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings, logits_processor=None, pixel_inputs=None
    ) -> torch.Tensor:
        """The policy's completions of a left-padded batch (transformers' `generate` with these
        settings and processors; `pixel_inputs`: an image-text prompt's pixel values and token
        types): every rank calls it, in lockstep where weights are sharded."""

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The whole adapter (peft's names, CPU tensors) on rank 0; collective, never gathers the base."""

    def save_state(self, folder: Path) -> None:
        """This rank's part of a checkpoint (optimizer, schedule, RNG), pickle-free."""

    def load_state(self, folder: Path) -> None: ...

    def memory_report(self) -> str | None:
        """One line on what this rank holds of the base, printed at start (None: nothing to say)."""


# --- registry ----------------------------------------------------------------------------------
BUILTIN = (single.SPEC, ddp.SPEC, deepspeed.SPEC, fsdp.SPEC)
BACKENDS: dict[str, BackendSpec] = {spec.name: spec for spec in BUILTIN}


def register(spec: BackendSpec) -> None:
    """Add a backend (its choices, cells and memory model appear everywhere the registry is read)."""
    BACKENDS[spec.name] = spec


def unregister(name: str) -> None:
    BACKENDS.pop(name, None)


def names() -> dict[str, str]:
    """Backend name -> its one-line description (the --backend choices in --help)."""
    return {name: spec.description for name, spec in BACKENDS.items()}


def stages() -> dict[int, str]:
    """Every --zero stage some backend runs -> which backends run it."""
    found: dict[int, list[str]] = {}
    for spec in BACKENDS.values():
        for stage in spec.stages:
            found.setdefault(stage, []).append(spec.name)
    return {stage: ", ".join(found[stage]) for stage in sorted(found)}


def several_processes(cfg) -> bool:
    """Whether a configuration runs several processes (--nproc N, torchrun, `plan --gpus N`)."""
    per_node, nodes = dist.processes(cfg)
    return per_node * nodes > 1


def spec_of(cfg) -> BackendSpec:
    """The backend a configuration selects: --backend as given; else the one whose stage --zero
    names (so `--zero 3` alone keeps working); else the default for one process or for several."""
    if cfg.backend and cfg.backend not in BACKENDS:
        raise UserError(f"--backend: got {cfg.backend!r}; choose one of {', '.join(BACKENDS)}")
    if cfg.zero not in stages():
        raise UserError(f"--zero: got {cfg.zero}; choose one of {', '.join(map(str, stages()))}")
    if cfg.backend:
        return BACKENDS[cfg.backend]
    if cfg.zero:
        return next(s for s in BACKENDS.values() if cfg.zero in s.stages)
    several = several_processes(cfg)
    return next(s for s in BACKENDS.values() if s.default and s.multi_process == several)


def backend_name(cfg) -> str:
    return spec_of(cfg).name


@dataclass(frozen=True)
class Cell:
    backend: str
    precision: str
    zero: int
    offload: str

    @property
    def spec(self) -> BackendSpec:
        return BACKENDS[self.backend]

    def flags(self) -> str:
        """The cell as the options that select it: '--precision 8bit with --zero 3 --offload cpu'."""
        rest = list(self.spec.flags(self.zero)) + ([f"--offload {self.offload}"] if self.offload != "none" else [])
        return f"--precision {self.precision}" + (" with " + " ".join(rest) if rest else "")

    def refusal(self) -> str | None:
        return self.spec.refusal(self.precision, self.zero, self.offload)

    def loads_layer_by_layer(self) -> bool:
        return self.spec.loads_layer_by_layer(self.precision, self.zero)


def cell_of(cfg) -> Cell:
    return Cell(backend_name(cfg), cfg.precision, cfg.zero, cfg.offload)


def layer_by_layer_refusal(cell: Cell, quantized: str | None) -> str | None:
    """Why this cell can't run a checkpoint, or None. Cells that stream the base layer by layer read
    plain tensors (converted per layer the way transformers converts them on load); a checkpoint
    that ships quantized weights (`quantized`: its quant_method, e.g. fp8, mxfp4) is dequantized
    only by transformers' whole-model loading."""
    if cell.loads_layer_by_layer() and quantized:
        return (
            f"{cell.flags()}: loads the base layer by layer, which reads plain tensors, but this checkpoint ships {quantized}-quantized "
            f"weights (dequantized only by transformers' whole-model loading); {cell.spec.layer_by_layer_alternative}"
        )
    return None


def check_layer_by_layer(cfg, quantized: str | None) -> None:
    """layer_by_layer_refusal as the one-line error, before anything is loaded."""
    reason = layer_by_layer_refusal(cell_of(cfg), quantized)
    if reason:
        raise UserError(reason)


def all_cells() -> list[Cell]:
    """Every cell any backend could be asked for (refused ones included)."""
    return [
        Cell(name, precision, stage, offload)
        for name, spec in BACKENDS.items()
        for stage in spec.stages
        for precision in PRECISIONS
        for offload in OFFLOADS
    ]


def supported_cells() -> list[Cell]:
    return [c for c in all_cells() if c.refusal() is None]


def check_compatibility(cfg, paths: bool = True) -> None:
    """The cell of this configuration, then (for `train`, not `plan`) the files it needs."""
    spec = spec_of(cfg)
    if cfg.zero not in spec.stages:
        runs_it = [s.name for s in BACKENDS.values() if cfg.zero in s.stages]
        raise UserError(
            f"--zero {cfg.zero} is not a stage of --backend {spec.name}; use --backend {' or '.join(runs_it)} (or leave --backend out)"
        )
    cell = cell_of(cfg)
    reason = cell.refusal()
    if reason:
        raise UserError(f"{cell.flags()}: {reason}")
    for other in BACKENDS.values():
        for option in other.options:
            if other is not spec and getattr(cfg, option, None):
                raise UserError(f"--{option.replace('_', '-')} belongs to --backend {other.name} (the {spec.name} backend runs)")
    if not spec.multi_process and several_processes(cfg):
        choices = " or ".join(" ".join(s.flags(s.stages[0])) for s in BACKENDS.values() if s.multi_process)
        raise UserError(f"several processes need a backend that coordinates them: use {choices} (or leave --backend out)")
    if not paths:
        return
    if spec.check_inputs:
        spec.check_inputs(cfg)


def check_sequence_parallel(cfg, config, world: int) -> None:
    """--sequence-parallel N on `world` processes: what it can serve for this model (its transformers
    `config`), before anything loads. Train asks it with the processes it runs, `plan` with its GPUs."""
    n = cfg.sequence_parallel
    if n == 1:
        return
    if not spec_of(cfg).multi_process:
        raise UserError(f"--sequence-parallel {n} splits rows across processes: run several (--nproc {n}), leaving --backend single out")
    if world % n:
        raise UserError(f"--sequence-parallel {n} must divide the number of processes ({world}): use --nproc {max(n, world // n * n)}")
    if cfg.objective != "sft":
        raise UserError(f"--sequence-parallel trains --objective sft for now, not {cfg.objective}; leave it out (or use sft)")
    if cfg.loss_chunk_size == 0:
        raise UserError("--sequence-parallel needs the chunked loss (each rank scores its slice of the row): leave --loss-chunk-size out")
    if cfg.compile:
        raise UserError("--sequence-parallel exchanges slices of rows inside attention, which --compile can't capture yet: leave it out")
    reason = sequence_parallel.refusal(config, n)
    if reason:
        raise UserError(f"--sequence-parallel {n}: {reason}")


def create(cfg, device: torch.device) -> Engine:
    module, cls = spec_of(cfg).engine.split(":")
    return getattr(importlib.import_module(module), cls)(cfg, device)


def matrix_markdown() -> str:
    """The compatibility matrix as the README shows it, generated from the backends' cells: one
    row per backend setup, one column per precision, each refusal's reason as a numbered note;
    setups refused for every precision are listed below it with their reason."""
    reasons: list[str] = []
    lines = ["| backend | " + " | ".join(PRECISIONS) + " |", "|---|" + "---|" * len(PRECISIONS)]
    not_offered = []
    for spec in BACKENDS.values():
        for stage in spec.stages:
            for offload in OFFLOADS:
                name = spec.label(stage) + OFFLOAD_LABEL[offload]
                row = [Cell(spec.name, precision, stage, offload).refusal() for precision in PRECISIONS]
                if all(row):
                    not_offered.append(f"- {name}: {row[0]}")
                    continue
                for reason in row:
                    if reason and reason not in reasons:
                        reasons.append(reason)
                cells = ["✓" if r is None else f"no ({reasons.index(r) + 1})" for r in row]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    notes = [f"{i}. {reason}" for i, reason in enumerate(reasons, start=1)]
    setups = [(spec.label(stage), spec.compiles(stage)) for spec in BACKENDS.values() for stage in spec.stages]
    compile_note = "`--compile` (bf16, fp16, fp32): " + ", ".join(label for label, ok in setups if ok)
    refused = [label for label, ok in setups if not ok]
    compile_note += f"; refused under {', '.join(refused)}" if refused else ""
    return "\n".join(lines + [""] + notes + ["", "Not offered:"] + not_offered + ["", compile_note])
