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
        failures, codes = watch(ranks)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not failures:
        return next((c for c in codes if c != 0), 0)
    r, code = cause(list(failures.items()))
    line = failure_line(r, code, output_dir, resume_command)
    if line:
        print(line, file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def failure_line(rank: int, code: int, output_dir: str, resume_command: str) -> str | None:
    """The job's one line for the rank that ended it: which rank, how, the last complete checkpoint and
    how to resume; None for a rank that refused its input (it said which and how to fix it, in its own
    line, and a resume would not help)."""
    if code == BAD_INPUT_EXIT:
        return None
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    if code == -signal.SIGKILL:
        how += " (the out-of-memory killer sends this)"
    good = ckpt.newest_complete(Path(output_dir).expanduser())
    kept = f"the last complete checkpoint is {good}" if good else "no checkpoint had been written"
    return f"error: rank {rank} {how}; the other ranks were stopped. {kept}. Continue with: {resume_command}"


BAD_INPUT_EXIT = 2  # a rank refused its input (lora_tune.errors.UserError), in its own `error:` line
STOPPED = (0, 130, 143)  # exit codes of a rank that finished, or stopped on SIGINT / SIGTERM as asked
GRACE_S = 5.0  # how long the other ranks get to notice a failed rank before they are killed


def watch(ranks: list, poll_s: float = 0.1) -> tuple[dict[int, int], list[int]]:
    """Wait for every rank; returns ({rank: exit code} of the ranks that failed on their own while
    others ran, or were killed, every rank's exit code). Once a rank has failed the job can't go on: the others get GRACE_S to notice
    (their collectives fail) and are then killed, so none is left waiting. Every failure seen within
    those seconds is a candidate for the cause (`cause`), since a survivor can exit before the
    killed rank it lost is reaped; the ranks killed here are not."""
    failures: dict[int, int] = {}
    first_at = None
    while any(p.poll() is None for p in ranks):
        failures.update({r: p.poll() for r, p in enumerate(ranks) if p.poll() not in (None, *STOPPED)})
        if failures and first_at is None:
            first_at = time.monotonic()
        if first_at is not None and time.monotonic() - first_at > GRACE_S:
            break
        time.sleep(poll_s)
    else:  # every rank ended on its own: those that exited with a code said why themselves; a killed one can't
        codes = [p.wait() for p in ranks]
        failures.update({r: c for r, c in enumerate(codes) if c < 0})
        return failures, codes
    for p in ranks:
        if p.poll() is None:
            p.kill()
    return failures, [p.wait() for p in ranks]


LOST_PEER_EXIT = 75  # a rank's exit code when another rank died under it


def cause(failed: list[tuple[int, int]]) -> tuple[int, int]:
    """(rank, exit code) of the failure that ended the job, among the ranks that ended on their own
    within seconds of the first. A rank that lost its peers is a consequence; the one that died is
    the cause. A rank killed by a signal comes before one that exited with a code: the survivor may
    die of the lost collective in a way not recognised as such (DeepSpeed's CPU collectives under
    ZeRO-2 exited with 250), and may do so before the killed rank is reaped."""
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
