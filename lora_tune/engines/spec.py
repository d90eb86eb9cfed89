"""What a backend declares about itself, statically: its name and flags, the cells it runs and why
it refuses the others, how it loads the base, how it lays the model states over ranks and what
that costs in speed. The registry (`lora_tune.engines`), the config's choices, the compatibility
matrix, `plan` and `plan --auto` all read these declarations; nothing outside a backend's own
module compares backend names.

Precisions and offload targets are the config's (`lora_tune.config`): one list of choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import get_args

from lora_tune.engines.options import Offload
from lora_tune.models.options import Precision

PRECISIONS: tuple[str, ...] = get_args(Precision)
OFFLOADS: tuple[str, ...] = get_args(Offload)
OFFLOAD_LABEL = {"none": "", "cpu": " + CPU offload", "nvme": " + NVMe offload"}


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model state one process holds, as the planner counts them: first for the whole
    model on one process, then (after a backend's `place`) what each rank keeps on its device."""

    weights: int  # the frozen base as loaded (quantized where it is)
    layer_weights: int  # one decoder layer of it: what a sharding backend gathers at a time
    trainable: int  # LoRA weights, fp32
    gradients: int  # of the LoRA weights, fp32
    optimizer: int  # optimizer states of the LoRA weights
    trainable_params: int  # LoRA parameter count (DeepSpeed's CPU Adam sizes its states from it)


@dataclass(frozen=True)
class Placement:
    """A backend's answer to "where do the model states live, per rank": on the device, and what
    CPU offload moved to host memory."""

    device: ModelStates
    host_optimizer: int = 0  # offloaded LoRA weights, gradients and optimizer states
    host_weights: int = 0  # offloaded (sharded) base weights


def whole(states: ModelStates) -> Placement:
    """Every state whole on every rank (one device, or plain data parallelism)."""
    return Placement(states)


def divided(value: int, world: int) -> int:
    """One rank's share of a state split over `world` ranks (rounded up: the last shard pads)."""
    return -(-value // world)


def share(
    states: ModelStates,
    world: int,
    *,
    weights: bool = False,
    trainable: bool = False,
    gradients: bool = False,
    optimizer: bool = False,
    layers_in_flight: int = 0,
) -> ModelStates:
    """The states with the named ones split over `world` ranks; a split base also holds
    `layers_in_flight` whole layers gathered for compute."""
    return replace(
        states,
        weights=divided(states.weights, world) + layers_in_flight * states.layer_weights if weights else states.weights,
        trainable=divided(states.trainable, world) if trainable else states.trainable,
        gradients=divided(states.gradients, world) if gradients else states.gradients,
        optimizer=divided(states.optimizer, world) if optimizer else states.optimizer,
    )


@dataclass(frozen=True)
class BackendSpec:
    """One backend, declared in its own module and registered in `lora_tune.engines`."""

    name: str  # the --backend value
    engine: str  # "module:Class" of its `Engine`, imported when a run starts
    description: str  # one line, shown in --help
    stages: tuple[int, ...]  # the --zero stages it runs (0: it has none)
    # Coordinates several processes (one device backends refuse N > 1: N independent runs would
    # each write the same output folder).
    multi_process: bool
    # What a run gets when neither --backend nor --zero names a backend: the default of one process
    # (multi_process False) and the default of several (True); one of each.
    default: bool
    refusal: Callable[[str, int, str], str | None]  # (precision, stage, offload) -> why this cell isn't offered
    loads_layer_by_layer: Callable[[str, int], bool]  # (precision, stage) -> streams the base layer by layer
    label: Callable[[int], str]  # (stage) -> how tables name it: "one device", "ZeRO-3", "FSDP2"
    flags: Callable[[int], tuple[str, ...]]  # (stage) -> the options that select it: ("--zero", "3")
    place: Callable[[ModelStates, int, str, int], Placement]  # (states, stage, offload, world) -> per rank
    slowdown: Callable[[int, str], float]  # (stage, offload) -> step-time multiplier vs one device (plan --auto)
    # What to use instead when a model can't be loaded layer by layer (checkpoints converted on load).
    layer_by_layer_alternative: str = ""
    # (stage) -> --compile verified under it (tests train compiled == eager on 2 ranks).
    compiles: Callable[[int], bool] = lambda stage: False
    # After backward and until its step ends, every rank holds every adapter gradient whole in
    # `p.grad` (one device, DDP after its all-reduce): what a type's step hooks read (AdaLoRA's allocator).
    whole_gradients: bool = False
    options: tuple[str, ...] = ()  # config fields only this backend reads (refused with another one)
    check_inputs: Callable[[object], None] | None = None  # backend-specific input checks (files), before loading
