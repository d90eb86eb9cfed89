"""A rank's part of a checkpoint, pickle-free: optimizer and schedule state as JSON with its tensors
in safetensors (loading can't run code), and the RNG states."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lora_tune.errors import UserError
from lora_tune.files import write_safetensors


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"torch_cuda_{i}"] = s
    return state


def save_rng(path: Path) -> None:
    write_safetensors(path, rng_state())


def load_rng(path: Path) -> None:
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} is unreadable or truncated ({e}); delete that checkpoint to resume from an older one") from None
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [state[k] for k in sorted(k for k in state if k.startswith("torch_cuda_"))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


# --- pickle-free state of sharded optimizers ------------------------------------------------------
def to_safe(obj, tensors: dict, path: str = "s", seen: dict | None = None):
    """JSON-able skeleton with tensors pulled out (saved with safetensors). Objects that are
    neither tensors nor plain data are dropped and taken from the live optimizer on load: DeepSpeed's
    state holds its ZeRO stage enum (kept as its int) and a loss scaler (static for our fp32 LoRA
    states). A tensor met twice (bitsandbytes' 8-bit states share one quantization map) is stored
    once and comes back shared; a different view of memory already stored is stored as a copy."""
    seen = {} if seen is None else seen
    if torch.is_tensor(obj):
        storage = (obj.device, obj.untyped_storage().data_ptr())
        key = (*storage, obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()), obj.dtype)
        if key in seen:
            return {"__tensor__": seen[key]}
        shares = any(k[:2] == storage for k in seen)
        seen[key] = path
        tensors[path] = obj.detach().cpu().clone() if shares else obj.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        pairs = [
            [to_safe(k, tensors, f"{path}.k{i}", seen), to_safe(v, tensors, f"{path}.{i}", seen)] for i, (k, v) in enumerate(obj.items())
        ]
        return {"__dict__": pairs}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [to_safe(v, tensors, f"{path}.{i}", seen) for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return {"__dropped__": type(obj).__name__}


def from_safe(obj, tensors: dict):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {from_safe(k, tensors): from_safe(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [from_safe(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj["tuple"] else items
        if "__dropped__" in obj:
            return None
    return obj


def save_safe_state(folder: Path, name: str, state) -> None:
    tensors: dict = {}
    skeleton = to_safe(state, tensors)
    write_safetensors(folder / f"{name}.safetensors", tensors)
    (folder / f"{name}.json").write_text(json.dumps(skeleton))


def load_safe_state(folder: Path, name: str):
    tensors_file, skeleton_file = folder / f"{name}.safetensors", folder / f"{name}.json"
    try:
        tensors = load_file(str(tensors_file))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{tensors_file} is unreadable or truncated ({e}); delete that checkpoint to resume from an older one") from None
    try:
        skeleton = json.loads(skeleton_file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{skeleton_file} is unreadable or truncated ({e}); delete that checkpoint to resume from an older one") from None
    return from_safe(skeleton, tensors)
