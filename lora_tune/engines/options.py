"""The options of the engines: which backend, ZeRO stage, offload, how many processes and how they split a row."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lora_tune.options import FREE, MATH, Options, fixed

# Offload targets; which run is each backend's call.
Offload = Literal["none", "cpu", "nvme"]


# On --resume: each rank saved its optimizer state in its backend's layout.
LAYOUT = fixed("holds each rank's optimizer state in that backend's layout")


class EngineOptions(Options):
    """The training backend (read by lora_tune.engines.registry and each backend)."""

    section = "engine"

    backend: str | None = Field(
        None,
        json_schema_extra={**LAYOUT, "registry": "names"},
        description="Training engine (see the compatibility matrix, docs/reference/matrix.md); default: the backend whose stage "
        "--zero names, else ddp with several processes, else one device.",
    )
    zero: int = Field(
        0,
        ge=0,
        json_schema_extra={**LAYOUT, "registry": "stages"},
        description="DeepSpeed ZeRO stage (implies --backend deepspeed): 1 (shard optimizer states), 2 (also gradients), 3 "
        "(also the base weights, partitioned while loading); 0 = no DeepSpeed.",
    )
    offload: Offload = Field(
        "none",
        json_schema_extra=fixed("holds the optimizer state of the optimizer that offload picks (DeepSpeed's CPU Adam) where it kept it"),
        description="With ZeRO or FSDP: offload optimizer states (ZeRO-3 and FSDP: also weights) to host RAM (cpu); nvme is "
        "refused, with the reason.",
    )
    zero_config: str | None = Field(
        None,
        json_schema_extra=MATH,
        description="A full DeepSpeed JSON (bucket sizes, overlap, ...); batch sizes, clipping and the stage are set from the "
        "other options.",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        json_schema_extra=fixed("counts its place in the data in micro-batches dealt to processes / N data-parallel groups"),
        description="Split every packed row across N ranks (Ulysses: an all-to-all around attention), each holding 1/N of its "
        "tokens, for rows longer than one device holds; --nproc must be a multiple of N (data parallel across the groups). SFT, "
        "with DDP, ZeRO-1/2/3 or FSDP2.",
    )
    nproc: int | None = Field(
        None,
        gt=0,
        json_schema_extra=FREE,
        description="Start N local processes (lora-tune's own launcher, with torchrun's environment). Not needed when launched by "
        "torchrun, deepspeed or accelerate.",
    )
