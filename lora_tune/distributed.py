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


LOST_PEER_EXIT = 75  # a rank's exit code when another rank died under it


def lost_peer(error: BaseException) -> bool:
    """True for the errors a collective raises when another rank has died mid-run."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    text = str(error)
    return isinstance(error, torch.distributed.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout"))


def launch(args: list[str], nproc: int, output_dir: str, resume_command: str) -> int:
    """Run this command (given without --nproc) as N local ranks and watch them; returns the
    job's exit code.

    Our own small launcher instead of torchrun, for what happens when a rank dies (the OOM killer,
    a crash): the others are stopped at once instead of waiting in a collective, and the job ends
    with one message that says which rank died, how, the last complete checkpoint and how to
    resume, instead of every rank's traceback.
    """
    import signal
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "LOCAL_SIZE": str(nproc), "LORA_TUNE_LAUNCHER": "1"}
    # Like torchrun: N ranks each using every core would oversubscribe the machine.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    ranks = [subprocess.Popen([sys.executable, "-m", "lora_tune", *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(nproc)]
    # SIGTERM / SIGINT go to every rank, which finish the step, agree to stop, checkpoint and exit.
    forward = lambda signum, frame: [p.send_signal(signum) for p in ranks if p.poll() is None]  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        first_failure = None
        while any(p.poll() is None for p in ranks):
            failed = [(r, p.poll()) for r, p in enumerate(ranks) if p.poll() not in (None, 0, 130, 143)]
            # A rank that lost its peers is a consequence; the one that died is the cause.
            failed.sort(key=lambda rc: rc[1] == LOST_PEER_EXIT)
            if failed and first_failure is None:
                first_failure = (*failed[0], time.monotonic())
            # Once a rank has failed, the job can't go on: the others get a few seconds to notice
            # (their collectives fail) and are then killed, so none is left waiting.
            if first_failure and time.monotonic() - first_failure[2] > 5:
                for p in ranks:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
        codes = [p.wait() for p in ranks]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if first_failure is None:
        return next((c for c in codes if c != 0), 0)
    r, code, _ = first_failure
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if code == -signal.SIGKILL:
        how += " (the out-of-memory killer sends this)"
    from lora_tune import checkpoint as ckpt
    from pathlib import Path

    good = ckpt.newest_complete(Path(output_dir).expanduser())
    kept = f"the last complete checkpoint is {good}" if good else "no checkpoint had been written"
    print(f"error: rank {r} {how}; the other ranks were stopped. {kept}. Continue with: {resume_command}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code
