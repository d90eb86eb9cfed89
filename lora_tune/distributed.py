"""What every multi-process run shares, whatever the backend: rank helpers, agreement between
ranks, and the `--nproc` launcher.

One rule holds throughout: rank 0 writes files and prints progress; every rank takes part in
the collectives (gathering LoRA weights, barriers), so none waits for another forever.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

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


def all_sum(value: float) -> float:
    """The sum of a number over all ranks (the number itself on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t[0])


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
