"""The engine seam: everything that differs by backend lives behind one interface.

The recipe (`lora_tune.recipe`) loads, trains, checkpoints and saves through `Engine` alone and
never asks which backend runs. Each backend owns:

* how the base is loaded and partitioned, and when the adapter is injected (`load`);
* forward/backward, the optimizer step, evaluation;
* gathering the adapter for saving, and writing/reading its own part of a checkpoint;
* its compatibility cells (`refusal`), from which the matrix in the README and the cells
  `plan --auto` searches are generated.

Backends: `single` (one process, one device), `deepspeed` (ZeRO-1/2/3, optional CPU offload) and
`fsdp` (PyTorch FSDP2, `fully_shard` per decoder layer, optional CPU offload). Their modules import
DeepSpeed / FSDP only when that backend runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Protocol

import torch

from lora_tune import distributed as dist
from lora_tune.errors import UserError

PRECISIONS = ("fp32", "bf16", "fp16", "8bit", "4bit")
OFFLOADS = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)


class Engine(Protocol):
    """One training backend. Called in this order: `load` -> (`load_adapter`) -> `prepare` ->
    (`load_state`) -> steps -> `adapter_state` / `save_state` at checkpoints."""

    name: ClassVar[str]
    # True where an overflowing step is routine and handled (fp16 loss scaling): such a skipped
    # update is not a "bad step".
    skips_overflow: bool

    def load(self, base_path: str, add_adapter: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
        """The base, loaded and partitioned as this backend needs, with the adapter injected by
        `add_adapter` at the moment that suits the backend. Returns what `add_adapter` made: the
        loss module (`lora_tune.loss.CausalLMLoss`, its peft model as `.peft_model`)."""

    def load_adapter(self, path: Path) -> None:
        """Adapter weights of a checkpoint into the (not yet prepared) model."""

    def prepare(self, model: torch.nn.Module, total_steps: int) -> None:
        """Optimizer, schedule and whatever wrapping the backend needs."""

    def forward_backward(self, batch, divisor: float) -> torch.Tensor:
        """Backward of this micro-batch's share of the step loss (`lora_tune.batching.MicroBatch`;
        summed over label tokens, divided by `divisor`); returns that share, detached."""

    def step(self) -> tuple[float, bool]:
        """Clip, optimizer and schedule step at the end of an optimizer step: (grad norm, applied)."""

    def zero_grad(self) -> None: ...

    @property
    def lr(self) -> float: ...

    def evaluate(self, batches: list) -> tuple[float, int]:
        """(summed token loss, label tokens) over the batches; collective where the backend is."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions of tokenized prompts (every rank, in lockstep where sharded)."""

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The whole adapter (peft's names, CPU tensors) on rank 0; collective, never gathers the base."""

    def save_state(self, folder: Path) -> None:
        """This rank's part of a checkpoint (optimizer, schedule, RNG), pickle-free where sharded."""

    def load_state(self, folder: Path) -> None: ...

    def memory_report(self) -> str | None:
        """One line on what this rank holds of the base, printed at start (None: nothing to say)."""


# --- registry ----------------------------------------------------------------------------------
BACKENDS = {"single": "lora_tune.engines.single:SingleDeviceEngine",
            "deepspeed": "lora_tune.engines.deepspeed:DeepSpeedEngine",
            "fsdp": "lora_tune.engines.fsdp:FSDPEngine"}


def backend_class(name: str):
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def backend_name(cfg) -> str:
    """--backend as given, else derived: --zero 1|2|3 means DeepSpeed (so `--zero` keeps working)."""
    chosen = getattr(cfg, "backend", None)
    if chosen:
        return chosen
    return "deepspeed" if cfg.zero else "single"


@dataclass(frozen=True)
class Cell:
    backend: str
    precision: str
    zero: int
    offload: str

    def flags(self) -> str:
        """The cell as the options that select it: '--precision 8bit with --zero 3 --offload cpu'."""
        rest = []
        if self.backend == "fsdp":
            rest.append("--backend fsdp")
        elif self.zero:
            rest.append(f"--zero {self.zero}")
        if self.offload != "none":
            rest.append(f"--offload {self.offload}")
        return f"--precision {self.precision}" + (" with " + " ".join(rest) if rest else "")


def refusal(backend: str, precision: str, zero: int, offload: str) -> str | None:
    """Why this cell is refused, or None when it runs. Each backend answers for its own cells."""
    return backend_class(backend).refusal(precision, zero, offload)


def layer_by_layer_refusal(cfg, model_type: str) -> str | None:
    """Why this cell can't run this model family, or None. Cells that stream the base layer by layer
    read each tensor under the model's own name; a family whose checkpoints transformers converts on
    load (Mixtral's per-expert tensors fused into one, renamed routers) can't be read that way."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    name = backend_name(cfg)
    if backend_class(name).loads_layer_by_layer(cfg.precision, cfg.zero) and get_checkpoint_conversion_mapping(model_type):
        cell = Cell(name, cfg.precision, cfg.zero, cfg.offload)
        fix = "use --zero 3 with --precision bf16 (zero.Init through from_pretrained)" if name == "fsdp" else "use --precision bf16 with --zero 3, or --zero 2"
        return f"{cell.flags()}: loads the base layer by layer, which {model_type} checkpoints don't allow (transformers converts their tensors on load); {fix}"
    return None


def check_layer_by_layer(cfg, model_type: str) -> None:
    """layer_by_layer_refusal as the one-line error, before anything is loaded."""
    reason = layer_by_layer_refusal(cfg, model_type)
    if reason:
        raise UserError(reason)


def all_cells() -> list[Cell]:
    """Every cell any backend could be asked for (refused ones included)."""
    cells = []
    for backend in BACKENDS:
        for zero in backend_class(backend).ZERO_STAGES:
            for precision in PRECISIONS:
                for offload in OFFLOADS:
                    cells.append(Cell(backend, precision, zero, offload))
    return cells


def supported_cells() -> list[Cell]:
    return [c for c in all_cells() if refusal(c.backend, c.precision, c.zero, c.offload) is None]


def check_compatibility(cfg, paths: bool = True) -> None:
    """The cell of this configuration, then (for `train`, not `plan`) the files it needs."""
    chosen = getattr(cfg, "backend", None)
    if chosen and chosen != "deepspeed" and cfg.zero:
        raise UserError(f"--zero {cfg.zero} is DeepSpeed's stage; it can't be combined with --backend {chosen}. Use --backend deepspeed (or leave --backend out)")
    name = backend_name(cfg)
    reason = refusal(name, cfg.precision, cfg.zero, cfg.offload)
    if reason:
        raise UserError(f"{Cell(name, cfg.precision, cfg.zero, cfg.offload).flags()}: {reason}")
    if paths and name == "single" and max(getattr(cfg, "nproc", None) or 1, dist.world_size()) > 1:
        # N independent single-device runs would each write the same output folder.
        raise UserError("several processes need a backend that coordinates them: add --zero 1 (data parallel, optimizer states sharded), --zero 2/3 or --backend fsdp")
    if paths and getattr(cfg, "zero_config", None) and not Path(cfg.zero_config).is_file():
        raise UserError(f"--zero-config: {cfg.zero_config} does not exist")
    if paths and getattr(cfg, "zero_config", None) and name != "deepspeed":
        raise UserError(f"--zero-config is a DeepSpeed file; it needs --zero 1|2|3 (the {name} backend runs)")


def create(cfg, device: torch.device) -> Engine:
    return backend_class(backend_name(cfg))(cfg, device)


def matrix_markdown() -> str:
    """The compatibility matrix as the README shows it, generated from the backends' cells: one
    row per backend setup, one column per precision, each refusal's reason as a numbered note;
    setups refused for every precision are listed below it with their reason."""
    names = {"single": "one device", "fsdp": "FSDP2"}
    reasons: list[str] = []
    lines = ["| backend | " + " | ".join(PRECISIONS) + " |", "|---|" + "---|" * len(PRECISIONS)]
    not_offered = []
    for backend in BACKENDS:
        for zero in backend_class(backend).ZERO_STAGES:
            for offload in OFFLOADS:
                name = (names.get(backend) or f"ZeRO-{zero}") + {"none": "", "cpu": " + CPU offload", "nvme": " + NVMe offload"}[offload]
                row = [refusal(backend, precision, zero, offload) for precision in PRECISIONS]
                if all(row):
                    not_offered.append(f"- {name}: {row[0]}")
                    continue
                for reason in row:
                    if reason and reason not in reasons:
                        reasons.append(reason)
                cells = ["✓" if r is None else f"no ({reasons.index(r) + 1})" for r in row]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    notes = [f"{i}. {reason}" for i, reason in enumerate(reasons, start=1)]
    return "\n".join(lines + [""] + notes + ["", "Not offered:"] + not_offered)
