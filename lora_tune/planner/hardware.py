"""The hardware a plan is for: GPU memory by name or size, host memory."""

from __future__ import annotations

from lora_tune.config import parse_size
from lora_tune.errors import UserError
from lora_tune.planner.memory import GIB

# Usable memory as drivers report it (a "16 GB" card shows ~15 GiB).
GPUS = {
    "t4": 15.0 * GIB,
    "l4": 22.5 * GIB,
    "a10g": 22.5 * GIB,
    "rtx4090": 23.6 * GIB,
    "rtx3090": 23.6 * GIB,
    "a100-40": 39.4 * GIB,
    "a100-80": 79.2 * GIB,
    "h100-80": 79.6 * GIB,
    "h200": 139.8 * GIB,
}


def gpu_memory_bytes(text: str) -> int:
    key = text.strip().lower()
    if key in GPUS:
        return int(GPUS[key])
    try:
        return parse_size(text, "--gpu-memory")
    except UserError:
        raise UserError(f"--gpu-memory: {text!r} is neither a size (e.g. 80GB) nor a known GPU ({', '.join(GPUS)})") from None


def cpu_memory_bytes(text: str | None) -> int | None:
    return parse_size(text, "--cpu-memory") if text else None
