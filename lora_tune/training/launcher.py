"""The `--nproc` launcher: run the same command as N local ranks and watch them.

Our own small launcher instead of torchrun, for what happens when a rank dies (the OOM killer, a
crash): the others are stopped at once instead of waiting in a collective, and the job ends with one
message that says which rank died, how, the last complete checkpoint and how to resume, instead of
every rank's traceback. The launcher holds the output folder's lock for the whole job (its ranks
know it from the environment); the caller has checked the input once before (`lora_tune.preflight`).
Also the two things a rank needs to know about its job: that it lost its peers, and that it stops
when its launcher dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from lora_tune.training import checkpoint as ckpt

LAUNCHER_ENV = "LORA_TUNE_LAUNCHER"  # set for the ranks our launcher starts: the launcher's pid


def launch_job(cfg, args: list[str], resume_command: str) -> int:
    """Hold the output folder's lock and run `lora-tune ARGS` as cfg.nproc ranks (the input already
    checked); returns the job's exit code."""
    lock = ckpt.OutputLock(Path(cfg.output_dir).expanduser()).acquire()
    os.environ[ckpt.LOCK_ENV] = str(lock.path.resolve())
    try:
        return launch(args, cfg.nproc or 1, cfg.output_dir, resume_command)
    finally:
        lock.release()
        os.environ.pop(ckpt.LOCK_ENV, None)


def launch(args: list[str], nproc: int, output_dir: str, resume_command: str) -> int:
    """Run this command (given without --nproc) as N local ranks and watch them; returns the
    job's exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "LOCAL_SIZE": str(nproc),
        LAUNCHER_ENV: str(os.getpid()),  # the ranks stop when this process dies (stop_with_parent)
    }
    # Like torchrun: N ranks each using every core would oversubscribe the machine.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    ranks = [
        subprocess.Popen([sys.executable, "-m", "lora_tune", *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(nproc)
    ]
    # SIGTERM / SIGINT go to every rank, which finish the step, agree to stop, checkpoint and exit.
    forward = lambda signum, frame: [p.send_signal(signum) for p in ranks if p.poll() is None]  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        first_failure = None
        while any(p.poll() is None for p in ranks):
            failed = [(r, p.poll()) for r, p in enumerate(ranks) if p.poll() not in (None, 0, 130, 143)]
            if failed and first_failure is None:
                first_failure = (*cause(failed), time.monotonic())
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
    good = ckpt.newest_complete(Path(output_dir).expanduser())
    kept = f"the last complete checkpoint is {good}" if good else "no checkpoint had been written"
    print(f"error: rank {r} {how}; the other ranks were stopped. {kept}. Continue with: {resume_command}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


LOST_PEER_EXIT = 75  # a rank's exit code when another rank died under it


def cause(failed: list[tuple[int, int]]) -> tuple[int, int]:
    """(rank, exit code) of the failure that ended the job, among those seen at one poll. A rank
    that lost its peers is a consequence; the one that died is the cause. A rank killed by a signal
    comes before one that exited with a code: the survivor may die of the lost collective in a way
    not recognised as such (DeepSpeed's CPU collectives under ZeRO-2 exited with 250), and a loaded
    machine polls late enough to see both."""
    return min(failed, key=lambda rc: (rc[1] == LOST_PEER_EXIT, rc[1] >= 0))


def lost_peer(error: BaseException) -> bool:
    """True for the errors a collective raises when another rank has died mid-run."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    text = str(error)
    return isinstance(error, torch.distributed.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout")
    )


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent(parent: int) -> None:
    """Have this process get SIGTERM when `parent` (the --nproc launcher) dies, however it dies
    (SIGKILL included): the rank then finishes its step, checkpoints with the others and exits,
    instead of training on without the launcher's lock and watchdog. Linux's parent-death signal,
    armed here in the rank itself (not in a fork hook of a threaded launcher); elsewhere a thread
    that watches the parent id."""
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) == 0
    except (OSError, AttributeError):
        armed = False
    if not armed:

        def watch():
            while os.getppid() == parent:
                time.sleep(1)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="lora-tune-parent-watch", daemon=True).start()
    elif os.getppid() != parent:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
