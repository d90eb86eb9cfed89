"""Files written so that a crash never leaves half of one, and deleted without following links:
what every room that writes (checkpoints, adapters, merged models, caches) shares."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from lora_tune.errors import UserError


def fsync_path(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk: a rename is only durable after both."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fsync_path(p)
    fsync_path(path)


def remove_tree(path: Path) -> None:
    """Delete a folder we wrote, or a link in its place: a symbolic link is unlinked, never followed,
    so what it points to (another run's checkpoint, a user's folder) is left as it is."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)  # rmtree itself never follows links inside the folder


def pid_alive(pid: str) -> bool:
    """Whether a process of that id runs on this machine (a temp file's writer)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


# --- the pieces a checkpoint holds ---------------------------------------------------------------
def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """safetensors bytes written with plain file I/O: a full disk is an OSError (ENOSPC) the loop can
    report in one line, not the library's own error type. Checkpoint tensors are small (LoRA)."""
    data = safetensors_bytes(tensors, metadata=metadata)
    with open(path, "wb") as f:
        f.write(data)


def writable_folder(out: Path, option: str) -> None:
    """Refuse, before anything is loaded, an output folder that can't be created or written: one
    under a file, on a read-only file system or without write permission. Writes nothing."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{option}: {out} would be inside {existing}, which is a file; give a folder")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise UserError(f"{option}: {existing} is on a read-only file system; choose another {option}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {existing} is not writable (permission denied); choose another {option}")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
