"""Checkpoints that survive crashes: temp folder, fsync, completion marker, rename.

A checkpoint folder `checkpoint-STEP/` is only ever seen complete: it is built under a hidden
temporary name, its files are flushed, the marker `COMPLETE` is written last, and then the whole
folder is renamed into place (atomic on POSIX). Resume only looks at folders with the marker, so a
kill at any moment leaves the previous checkpoint as the newest valid one.

Contents: the adapter (safetensors); per rank, optimizer and scheduler state (tensors in
safetensors, the rest as JSON: no pickle anywhere, so loading can't run code) and RNG states
(safetensors); the trainer state (JSON).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from lora_tune.engines import ranks as dist
from lora_tune.errors import UserError
from lora_tune.files import fsync_path, fsync_tree, pid_alive, remove_tree

MARKER = "COMPLETE"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def is_checkpoint_name(name: str) -> bool:
    return bool(_NAME.match(name))


def step_of(folder: Path) -> int:
    """The step of a `checkpoint-STEP` folder."""
    return int(_NAME.match(folder.name).group(1))


def list_checkpoints(output_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete, incomplete) checkpoint folders, oldest first."""
    complete, incomplete = [], []
    if not output_dir.is_dir():
        return complete, incomplete
    for p in output_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            (complete if (p / MARKER).is_file() else incomplete).append(p)
    return sorted(complete, key=step_of), sorted(incomplete, key=step_of)


def remove_leftovers(output_dir: Path) -> list[Path]:
    """Delete hidden temp / replaced folders left by a process killed mid-save (never valid), and the
    temporary files of an adapter write it was killed in."""
    if not output_dir.is_dir():
        return []
    leftovers = sorted(p for p in output_dir.glob(".checkpoint-*") if ".tmp-" in p.name or ".old-" in p.name)
    leftovers += sorted(p for p in output_dir.glob(".adapter_*.tmp-*") if not pid_alive(p.name.rsplit("-", 1)[-1]))
    for p in leftovers:
        remove_tree(p)
    return leftovers


def newest_complete(output_dir: Path) -> Path | None:
    complete, _ = list_checkpoints(output_dir)
    return complete[-1] if complete else None


class CheckpointWriter:
    """A temp folder to fill (`begin`), then committed atomically (`commit`) or removed (`abort`),
    leaving the previous checkpoints untouched either way.

    The temp name depends only on the step, so that in a multi-process run every rank writes its
    own part into the folder rank 0 created, and rank 0 commits it.
    """

    def __init__(self, output_dir: Path, step: int):
        self.output_dir = output_dir
        self.final = output_dir / f"checkpoint-{step}"
        self.tmp = output_dir / f".checkpoint-{step}.tmp-{step}"

    def begin(self) -> Path:
        remove_tree(self.tmp)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def abort(self) -> None:
        remove_tree(self.tmp)

    def commit(self) -> None:
        try:
            fsync_tree(self.tmp)
            (self.tmp / MARKER).write_text("ok\n")
            fsync_tree(self.tmp)
            if self.final.exists():  # a re-save of the same step (e.g. after a resume)
                stale = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
                os.replace(self.final, stale)
                os.replace(self.tmp, self.final)
                remove_tree(stale)
            else:
                os.replace(self.tmp, self.final)
            fsync_path(self.output_dir)
        except BaseException:
            self.abort()
            raise


def rotate(output_dir: Path, keep: int | None) -> list[Path]:
    """Remove the oldest complete checkpoints beyond `keep`; the newest is never among them. A
    checkpoint that is a symbolic link (into another run's folder, say) loses the link only."""
    if not keep:
        return []
    complete, _ = list_checkpoints(output_dir)
    doomed = complete[:-keep] if len(complete) > keep else []
    for p in doomed:
        if p.is_symlink():
            p.unlink()
            continue
        # Drop the marker first: a crash mid-delete leaves an incomplete folder, never a "complete"
        # one with missing files.
        (p / MARKER).unlink(missing_ok=True)
        remove_tree(p)
    return doomed


@dataclass
class TrainerState:
    """What, besides the engines' own state, an exact resume needs (in trainer_state.json)."""

    step: int = 0
    tokens_seen: int = 0
    bad_steps_in_a_row: int = 0
    best_eval_loss: float | None = None
    # Settings changed on resume (--allow-config-change), each {"step": resumed at, "changed": {key: [old, new]}}.
    config_changes: list = field(default_factory=list)

    @classmethod
    def saved(cls, state: dict) -> TrainerState:
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


def write(
    output_dir: Path, step: int, keep: int | None, rank_part: Callable[[Path], None], main_part: Callable[[Path], None]
) -> list[Path]:
    """One checkpoint of a run on any number of ranks: rank 0 opens the temporary folder, every rank
    writes its part (`rank_part`), rank 0 adds the run's own (`main_part`: adapter, trainer state)
    and commits, then rotates old checkpoints beyond `keep` (returned). A failure on any rank aborts
    the folder on every rank: all agree first, so none waits in a barrier for a rank that gave up."""
    writer = CheckpointWriter(output_dir, step)
    main = dist.is_main()
    if main:
        writer.begin()
    dist.barrier()
    error = None
    try:
        rank_part(writer.tmp)
        if main:
            main_part(writer.tmp)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agreed
        error = e
    if dist.any_rank(error is not None):  # every rank's part is written (or none commits)
        if main:
            writer.abort()
        raise error or OSError(f"another rank could not write its part of checkpoint-{step}")
    if main:
        try:
            writer.commit()  # aborts its folder itself on failure
        except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agreed
            error = e
    if dist.any_rank(error is not None):
        raise error or OSError(f"rank 0 could not commit checkpoint-{step}")
    return rotate(output_dir, keep) if main else []


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise UserError(f"{path} is unreadable or corrupt ({e}); delete that checkpoint to resume from an older one") from None


def read_trainer_state(path: Path) -> dict:
    """trainer_state.json, checked to be what `write` saved: the TrainerState fields as numbers, the
    recorded settings as a mapping. Anything else is named in one line."""
    state = read_json(path)

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    ok = isinstance(state, dict) and all(whole(state.get(k)) for k in ("step", "tokens_seen", "bad_steps_in_a_row"))
    ok = ok and (state.get("best_eval_loss") is None or isinstance(state["best_eval_loss"], (int, float)))
    ok = ok and isinstance(state.get("math_config", {}), dict) and whole(state.get("world_size", 1))
    ok = ok and isinstance(state.get("config_changes", []), list)
    if not ok:
        raise UserError(f"{path} is not a trainer state lora-tune wrote; delete that checkpoint to resume from an older one")
    return state


# --- one writer per output folder ----------------------------------------------------------------
LOCK_NAME = ".lora-tune.lock"
LOCK_ENV = "LORA_TUNE_LOCK_HELD"  # set for the ranks of a job whose launcher holds the lock


def open_lock_file(path: Path, create: bool) -> int | None:
    """A file descriptor on the lock file, opened without following a symbolic link (a link there
    could point at any file of the user's, which the lock would then write into and truncate) and
    only when it is a regular file; None when it does not exist and `create` is off (then it is
    opened read-only: looking writes nothing)."""
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise UserError(
            f"--output-dir: {path} is a symbolic link (to {os.readlink(path)}); lora-tune never writes through links: remove it"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"--output-dir: {path} is not a regular file; remove it")
    return fd


def read_lock(output_dir: Path) -> tuple[str, bool] | None:
    """(the lock file's note, whether a live process holds the lock), or None where there is no lock
    file or our own launcher holds it for this job. Writes nothing."""
    path = output_dir / LOCK_NAME
    if os.environ.get(LOCK_ENV) == str(path.resolve()):
        return None
    fd = open_lock_file(path, create=False)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        note = f.read(200).decode("utf-8", errors="replace").strip()
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return note, True
        fcntl.flock(f, fcntl.LOCK_UN)
    return note, False


def lock_holder(output_dir: Path) -> str | None:
    """Who holds the output folder's lock ("pid N on HOST since T"), or None. Writes nothing."""
    lock = read_lock(output_dir)
    return (lock[0] or "another process") if lock and lock[1] else None


def left_by_a_stopped_run(output_dir: Path) -> bool:
    """Whether the last run in OUTPUT_DIR ended without reaching its clean end (killed, or the
    machine lost): its lock note is still there and nobody holds the lock. In the ranks of a job
    whose launcher holds the lock, the launcher already asked before starting them: True."""
    if os.environ.get(LOCK_ENV) == str((output_dir / LOCK_NAME).resolve()):
        return True
    lock = read_lock(output_dir)
    return bool(lock and lock[0] and not lock[1])


class OutputLock:
    """An exclusive flock on OUTPUT_DIR/.lora-tune.lock for as long as the run writes there.

    The kernel drops the lock when its process dies, however it dies, so a lock left by a killed
    run never blocks the next one (the file is only a note of who held it last). The file is never
    opened through a symbolic link, so the note can't land in (or truncate) anything else."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / LOCK_NAME
        self.file = None

    def acquire(self) -> OutputLock:
        if os.environ.get(LOCK_ENV) == str(self.path.resolve()):
            return self  # our launcher holds it for the whole job
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = os.fdopen(open_lock_file(self.path, create=True), "rb+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read(200).decode("utf-8", errors="replace").strip() or "another process"
            f.close()
            raise UserError(
                f"--output-dir: {self.path.parent} is being written by another lora-tune run ({holder}); wait for it to end or "
                "choose another --output-dir"
            ) from None
        f.seek(0)
        previous = f.read(200).decode("utf-8", errors="replace").strip()  # a note; a garbage one is taken over all the same
        if previous:
            logging.getLogger("lora_tune").info(
                "took over the lock of %s, left by a run that is no longer running (%s)", self.path.parent, previous
            )
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        f.flush()
        self.file = f
        return self

    def release(self) -> None:
        if self.file is not None:
            self.file.seek(0)
            self.file.truncate()  # a clean end leaves no note behind
            self.file.close()  # closing drops the flock
            self.file = None
