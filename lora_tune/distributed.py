"""Everything that differs when a run spans several processes: the compatibility matrix, the
torchrun launcher, the DeepSpeed config, rank helpers, and a pickle-free format for the ZeRO
optimizer state.

One rule holds throughout: rank 0 writes files and prints progress; every rank takes part in
the collectives (gathering LoRA weights, barriers), so none waits for another forever.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from lora_tune.errors import UserError

# The compatibility matrix: precision x ZeRO stage x offload. `refusal` is its one source: a cell
# either runs (and the test suite exercises it) or is refused before loading, with the reason.
PRECISIONS = ("fp32", "bf16", "fp16", "8bit", "4bit")
OFFLOADS = ("none", "cpu", "nvme")


def refusal(precision: str, zero: int, offload: str) -> str | None:
    """Why this cell is refused, or None when it runs."""
    if zero == 0:
        return None if offload == "none" else "--offload needs ZeRO (--zero 2 or 3)"
    if precision == "fp16":
        # DeepSpeed's fp16 mode casts the LoRA weights to fp16 under a loss scaler of its own; its
        # CPU backend has no fp16, so that path can't be tested here and is not offered.
        return "fp16 under ZeRO needs DeepSpeed's own loss scaler, which is not wired (untestable without a GPU); use --precision bf16 (Ampere or newer) or --zero 0"
    if precision == "8bit" and zero == 3:
        # Tried: DeepSpeed does partition the int8 data, but bitsandbytes keeps the whole matrix
        # referenced as weight.CB, so every rank still holds the full base and nothing is saved.
        return "8-bit (LLM.int8) weights can't be partitioned by ZeRO-3: bitsandbytes keeps each whole int8 matrix on every rank (weight.CB; bitsandbytes #1249); use --precision 4bit or bf16 with --zero 3, or 8bit with --zero 2"
    if offload == "nvme":
        # Tried with DeepSpeed 0.19 (libaio built): swapping parameters fails mid-forward ("Not
        # enough buffers", DeepSpeed #3062); swapping only optimizer states trains, but its
        # state_dict holds empty tensors for them and its loader reads swap files it has just
        # purged, so such a run could never resume.
        return "DeepSpeed's NVMe swapping can't checkpoint and resume a LoRA run (swapped optimizer states don't reload; parameter swapping fails, DeepSpeed #3062); use --offload cpu"
    return None


SUPPORTED = {(p, z, o) for p in PRECISIONS for z in (2, 3) for o in OFFLOADS if refusal(p, z, o) is None}


def check_compatibility(cfg, paths: bool = True) -> None:
    """The matrix cell, then (for `train`, not `plan`) the files and folders it needs."""
    reason = refusal(cfg.precision, cfg.zero, cfg.offload)
    if reason:
        cell = f"--offload {cfg.offload}" if cfg.zero == 0 else f"--precision {cfg.precision} with --zero {cfg.zero}" + (f" --offload {cfg.offload}" if cfg.offload != "none" else "")
        raise UserError(f"{cell}: {reason}")
    if not paths:
        return
    if cfg.zero_config and not Path(cfg.zero_config).is_file():
        raise UserError(f"--zero-config: {cfg.zero_config} does not exist")


# --- ranks ---------------------------------------------------------------------------------------
def rank() -> int:
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


def launched() -> bool:
    """True inside torchrun / deepspeed / accelerate launch (they all set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def init(cfg) -> None:
    if cfg.zero == 0 and world_size() == 1:
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def any_rank(flag: bool) -> bool:
    """True if the flag is set on any rank: used so that all ranks stop at the same step."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def token_weighted_mean(value: float, tokens: int) -> float:
    """The mean over every rank's label tokens of a per-rank token mean (itself on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value * tokens, float(tokens)], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t[0] / t[1]) if t[1] > 0 else value


def launch(args: list[str], nproc: int) -> int:
    """Run this command (given without --nproc) under torchrun with N local processes; returns
    its exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "lora_tune", *args]
    child = subprocess.Popen(cmd)
    # Pass SIGTERM / SIGINT on: torchrun forwards them to every rank, which finish the step,
    # agree to stop, checkpoint and exit; the launcher waits for that instead of orphaning them.
    import signal

    forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --- DeepSpeed config ---------------------------------------------------------------------------
def deepspeed_config(cfg) -> dict:
    config = json.loads(Path(cfg.zero_config).read_text()) if cfg.zero_config else {}
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = cfg.zero
    if cfg.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", **zero.get("offload_optimizer", {})}
        if cfg.zero == 3:
            zero["offload_param"] = {"device": "cpu", **zero.get("offload_param", {})}
    config["zero_optimization"] = zero
    # Explicit numbers: DeepSpeed's "auto" fill miscounts the world size on CPU.
    config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    config["gradient_accumulation_steps"] = cfg.grad_accum
    config["train_batch_size"] = cfg.micro_batch_size * cfg.grad_accum * world_size()
    config["gradient_clipping"] = cfg.max_grad_norm
    # LoRA weights are fp32 already and autocast runs the compute dtype, so DeepSpeed keeps no
    # extra master copy and needs no loss scaler.
    config["bf16"] = {"enabled": False}
    config["fp16"] = {"enabled": False}
    config["zero_allow_untested_optimizer"] = True
    config.setdefault("steps_per_print", 10**9)
    return config


def partition_report(model) -> str:
    """What this rank holds of the frozen base after ZeRO-3 partitioned it (quantized bases count
    their packed storage elements)."""
    base = [p for p in model.parameters() if not p.requires_grad]
    local = sum(p.ds_tensor.ds_numel for p in base)
    full = sum(p.ds_numel for p in base)
    return f"zero-3: rank {rank()} holds {local:,} of {full:,} base parameters"


def hf_deepspeed_config(ds_config: dict):
    """Tell transformers (and peft) that ZeRO-3 is on; the object must stay referenced."""
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


# --- pickle-free optimizer state -------------------------------------------------------------------
def to_safe(obj, tensors: dict, path: str = "s"):
    """JSON-able skeleton with tensors pulled out (saved with safetensors). DeepSpeed's state holds
    two objects: the ZeRO stage enum (kept as its int) and the loss scaler (static for our fp32
    LoRA states, so dropped and taken from the live optimizer on load)."""
    from enum import Enum

    if torch.is_tensor(obj):
        tensors[path] = obj.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {"__dict__": [[to_safe(k, tensors, f"{path}.k{i}"), to_safe(v, tensors, f"{path}.{i}")] for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [to_safe(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
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
    from safetensors.torch import save_file

    tensors: dict = {}
    skeleton = to_safe(state, tensors)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(skeleton))


def load_safe_state(folder: Path, name: str):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / f"{name}.safetensors"))
        skeleton = json.loads((folder / f"{name}.json").read_text())
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise UserError(f"{folder / name}.* is unreadable or truncated ({e}); delete that checkpoint to resume from an older one") from None
    return from_safe(skeleton, tensors)
