"""The reference policy's log-probabilities (DPO, IPO, KTO): computed once before training and kept
(in the data cache and the run folder), or at every step with the adapter disabled."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lora_tune.data.cache import cache_root as data_cache_root
from lora_tune.errors import UserError
from lora_tune.files import file_digest, write_safetensors
from lora_tune.training.objectives import registry as objectives

if TYPE_CHECKING:
    from lora_tune.config import TrainConfig
    from lora_tune.data.prepare import PreparedData
    from lora_tune.training.objectives.registry import Objective

log = logging.getLogger("lora_tune")


@dataclass(frozen=True)
class ReferencePlan:
    """The reference policy's log-probabilities: computed before training ("precompute", kept in
    `cache` when the data cache is on, and in the run folder) or in every step ("per-step")."""

    mode: str
    cache: Path | None


def reference_plan(cfg: TrainConfig, objective: Objective, data: PreparedData, base: list, trained: int, per_epoch: int):
    """Where this run's reference log-probabilities come from, said in the log. Keyed for the cache
    by what they depend on: the data, the base (its id and content fingerprint), the starting
    adapter, the compute precision."""
    if not objective.reference:
        return None
    if cfg.init_adapter and cfg.reference == "per-step":
        raise UserError(
            "--reference per-step disables the adapter to get the reference, which with --init-adapter is not the starting "
            "model; use --reference precompute (or auto)"
        )
    cache = None
    if cfg.data_cache:
        adapter = file_digest(Path(cfg.init_adapter).expanduser() / "adapter_model.safetensors") if cfg.init_adapter else None
        key = hashlib.sha256(json.dumps([data.fingerprint, *base, adapter, cfg.precision, cfg.max_seq_len]).encode()).hexdigest()[:24]
        cache = data_cache_root(cfg) / "reference" / f"{key}.safetensors"
    mode = objectives.reference_mode(cfg, objective, trained, per_epoch, cached=cache is not None and cache.is_file())
    why = {
        "precompute": "one pass over the data before training" + (" (cached for later runs)" if cache is not None else ""),
        "per-step": "a forward with the adapter disabled in every step",
    }[mode]
    if cfg.reference != "auto":
        why += f" (--reference {cfg.reference})"
    elif mode == "per-step":
        why += " (this run scores fewer units than the data holds, and none are cached)"
    log.info("reference for %s: %s", objective.name, "from the cache" if mode == "precompute" and cache and cache.is_file() else why)
    return ReferencePlan(mode, cache)


REFERENCE_FILE = "reference_logps.safetensors"


def write_tables(path: Path, tables: dict[str, torch.Tensor]) -> None:
    """Atomically: a temp name, then renamed (a killed run leaves no half file to read back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_safetensors(tmp, {k: v.contiguous() for k, v in tables.items()})
    os.replace(tmp, path)


def read_tables(path: Path, expected: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor] | None:
    """The saved tables when they fit this data (their shapes), else None (recomputed)."""
    try:
        tables = load_file(str(path))
    except (SafetensorError, OSError):
        log.warning("ignoring unreadable reference log-probabilities in %s; computing them again", path)
        return None
    if {k: tuple(v.shape) for k, v in tables.items()} != expected:
        return None
    return tables
