"""What an adapter type declares (`AdapterType`), shared by the type modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class StepHooks(Protocol):
    """What a type does around each optimizer step beyond its forward (AdaLoRA's rank allocation), made
    by the engine with its optimizer (`step_hooks(peft_model, total_steps)`) and run by the engines whose
    every rank holds every adapter gradient whole until the step ends (BackendSpec.whole_gradients)."""

    def add_penalty_gradients(self) -> None: ...  # once per step, before clipping

    def after_step(self, applied: bool) -> None: ...  # after the optimizer step, before zeroing the gradients

    def state_dict(self) -> dict: ...  # in each rank's checkpoint part

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class AdapterType:
    """A peft adapter type: its name (peft's, lower case), the peft config it builds from the run's
    options and targets (`build(cfg, modules, model_type)`), which of --rank / --alpha / --dropout
    it maps to which of its own knobs (None: it has none, the option is ignored and said so), and
    whether peft ships bitsandbytes layers for it (an 8/4-bit base). `reset(layer)`: peft's own
    per-layer init of the type's default (init_weights=True) on one tuner layer, run from a generator
    seeded by the layer's name, so a layer filled where it is loaded (FSDP2 streams the base in) starts
    as on one process (None for LoRA, whose inits lora_tune.models.inits runs). `step_hooks`: what
    the type does around each optimizer step (StepHooks), None for most; `check_steps(cfg, total_steps)`: its refusal of a
    run length, before loading."""

    name: str
    build: Callable
    knobs: dict[str, str | None]
    quantized: bool = False
    reset: Callable | None = None
    # peft builds it on a base ZeRO-3 has already partitioned (it sizes the adapter from each layer's
    # in/out features or DeepSpeed's ds_shape; LoHa reads the weight's own shape, empty on every rank).
    partitioned_base: bool = True
    # Makes the type's fixed (never trained) tensors real on a meta skeleton, before its layers stream
    # in: VeRA's projections, shared by every layer; OFT's index buffers.
    fixed: Callable | None = None
    step_hooks: Callable[..., StepHooks] | None = None
    check_steps: Callable | None = None
    # What one adapted linear (n_in -> n_out) holds, for the planner where peft can't build the type on a
    # meta skeleton: (element counts of its trained tensors, bytes of its fixed tensors); see BOFT.
    planned: Callable[[int, int, object], tuple[list[int], int]] | None = None
    state_bytes: int = 0  # per trained element, kept by the step hooks beside the optimizer (the planner counts it)
    options: tuple[str, ...] = ()  # config fields only this type reads (refused with another one)
