"""The hardware a plan is for: GPU memory by name or size, host memory."""

from __future__ import annotations

import re

from lora_tune.errors import UserError
from lora_tune.options import parse_size
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


def compact(name: str) -> str:
    """A GPU name as people write it, reduced to what tells GPUs apart: 'NVIDIA GeForce RTX 4090' and
    '4090' -> '4090', 'A100-80GB' -> 'a10080', 'H100 SXM' -> 'h100sxm'."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for word in ("nvidia", "geforce", "tesla", "rtx"):
        key = key.replace(word, "")
    return key.removesuffix("gb")


# Short forms people type, beyond the table's names; ambiguous ones are refused with the choices.
SHORT = {
    **{compact(name): name for name in GPUS},
    "a10": "a10g",
    "h100": "h100-80",
    "h100sxm": "h100-80",
    "h100pcie": "h100-80",
    "h200sxm": "h200",
}
AMBIGUOUS = {"a100": "a100-40 or a100-80"}


def gpu_memory_bytes(text: str) -> int:
    """Memory of one GPU: a known GPU by name (as people shorten it), or a size with its unit. A
    bare number that is no GPU's name is refused: `24` is not 24 bytes."""
    key = compact(str(text))
    if key in SHORT:
        return int(GPUS[SHORT[key]])
    if key in AMBIGUOUS:
        raise UserError(f"--gpu-memory: {text!r} comes in more than one size; write {AMBIGUOUS[key]}")
    if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", str(text)):
        raise UserError(
            f"--gpu-memory: {text!r} is a bare number, neither a size with its unit nor a GPU lora-tune knows; write the "
            f"memory with its unit (e.g. 24GB or 24GiB) or a GPU name ({', '.join(GPUS)})"
        )
    return parse_size(text, "--gpu-memory", hint=f", or a known GPU ({', '.join(GPUS)})")


def cpu_memory_bytes(text: str | None) -> int | None:
    return parse_size(text, "--cpu-memory") if text else None
