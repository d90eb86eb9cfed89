"""Where a command after training may write: the one guard of `merge`, `export` (every format),
`report` and `eval`, checked before anything is loaded.

An output never is, holds or lies inside what is not the command's to replace: a training run (its
adapter, checkpoints, metrics), a model folder (a base's config.json and weights), the command's own
inputs, the current folder, or a folder lora-tune did not write. A folder output (a merged model, an
Ollama folder) is replaced whole, so `--overwrite` only ever replaces one that lora-tune wrote: it
holds `MARK`, written last into every folder output. A file output (a GGUF, a plot, eval results)
may sit in a run's own folder, the default of `report` and `eval`, but replaces only a file of the
kind the command writes there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from lora_tune import __version__
from lora_tune.errors import UserError
from lora_tune.training import checkpoint as ckpt
from lora_tune.training.run_folder import ADAPTER_FILES

MARK = "lora_tune_output.json"  # in every folder lora-tune writes as an output: what may be replaced
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def write_mark(folder: Path, command: str, **facts) -> None:
    """The note that says lora-tune wrote `folder` (and from what): a later --overwrite may replace it."""
    note = {"written_by": f"lora-tune {__version__}", "command": command, **{k: str(v) for k, v in facts.items()}}
    (folder / MARK).write_text(json.dumps(note, indent=2))


def written_by_us(folder: Path) -> bool:
    return (folder / MARK).is_file() and not (folder / MARK).is_symlink()


def is_run(folder: Path) -> bool:
    """A training run's folder or any PEFT adapter folder (a checkpoint is one too)."""
    marks = ("lora_tune_config.yaml", *ADAPTER_FILES, ckpt.LOCK_NAME)
    return any(os.path.lexists(folder / name) for name in marks) or bool(ckpt.list_checkpoints(folder)[0])


def is_checkpoint(folder: Path) -> bool:
    return ckpt.is_checkpoint_name(folder.name) and is_run(folder.parent)


def is_model(folder: Path) -> bool:
    """A model's folder: config.json beside weights (a base, a hub snapshot, a merged model)."""
    if not (folder / "config.json").is_file():
        return False
    return any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir())


def _owner(folder: Path) -> str | None:
    """What `folder` is, when it is someone else's to keep: None when lora-tune may write there."""
    if is_checkpoint(folder):
        return f"a checkpoint of the run {folder.parent}"
    if is_run(folder):
        return "a training run's folder (adapter, checkpoints, metrics)"
    if is_model(folder) and not written_by_us(folder):
        return "a model's folder (config.json and weights lora-tune did not write)"
    return None


def check_output(
    out: Path,
    command: str,
    *,
    folder: bool,
    overwrite: bool = False,
    replaces: bool = False,
    inputs: dict[str, Path] | None = None,
    ours: Callable[[Path], bool] | None = None,
    option: str = "--output",
    said: str | None = None,
) -> Path:
    """Refuse, in one line, an output `command` must not write; returns it (`~` expanded).

    `folder`: the output is a folder replaced whole (else one file); `overwrite`: --overwrite, an
    existing output may be replaced (a folder only when lora-tune wrote it); `replaces`: the command
    has no --overwrite and replaces its file output (report, eval); `inputs`: the folders the command
    reads ({what: folder}), never written, held or written into; `ours(path)`: whether an existing
    file in a run's folder is of the kind the command writes, the only kind it replaces there;
    `said`: how the messages name the output (default "OPTION: OUT")."""
    out = Path(out).expanduser()
    said = said or f"{option}: {out}"
    never = f"{command} never writes there" + ("" if replaces else ", --overwrite or not")
    if out.is_symlink():
        raise UserError(f"{said} is a symbolic link; {command} never writes through links. Choose another {option}")
    resolved = out.resolve()  # "." and ".." as the folders they name
    for what, path in (inputs or {}).items():
        path = Path(path).expanduser().resolve()
        if resolved == path:
            relation = "is"
        elif path in resolved.parents:
            relation = "is inside"
        elif folder and resolved in path.parents:
            relation = "contains"
        else:
            continue
        raise UserError(f"{said} {relation} the {what} folder {path}; {never} (it would destroy its own input). Choose another {option}")
    if folder:
        cwd = Path.cwd().resolve()
        if resolved == cwd or resolved in cwd.parents:
            raise UserError(
                f"{said} is the current folder or holds it, and {command} replaces its output folder whole; name a new folder, "
                f"e.g. {option} {out / command}"
            )
        if os.path.ismount(resolved):
            raise UserError(f"{said} is a mount point, which can't be replaced; name a new folder inside it")
    for parent in resolved.parents:
        owner = _owner(parent)
        if owner is None:
            continue
        if not folder and parent == resolved.parent and is_run(parent) and not is_checkpoint(parent):
            continue  # a file in a run's own folder (the plot, eval results): replacing only its own kind, below
        raise UserError(f"{said} is inside {parent}, {owner}; {never}. Choose a place outside it")
    if folder:
        _check_folder(resolved, command, overwrite, option, said, never)
    elif resolved.is_dir():
        raise UserError(f"{said} is a folder; give a file name")
    elif resolved.exists():
        if not (overwrite or replaces):
            raise UserError(f"{said} already exists; choose another path or pass --overwrite")
        if is_run(resolved.parent) and not (ours and ours(resolved)):
            raise UserError(f"{said} is a file of the run in {resolved.parent}, not one {command} wrote; {never}. Choose another {option}")
    return out


def _check_folder(resolved: Path, command: str, overwrite: bool, option: str, said: str, never: str) -> None:
    """An existing folder output: replaced only when it is lora-tune's own output, holding no folder."""
    if resolved.exists() and not resolved.is_dir():
        raise UserError(f"{said} is a file; {command} writes a folder there")
    entries = sorted(resolved.iterdir()) if resolved.is_dir() else []
    if not entries:
        return
    owner = _owner(resolved)
    if owner:
        raise UserError(f"{said} is {owner}; {never}. Choose another {option}")
    if not written_by_us(resolved):
        raise UserError(f"{said} is not empty and lora-tune did not write it (it holds no {MARK}); {never}. Choose a new or empty folder")
    folders = [p.name for p in entries if p.is_dir() and not p.is_symlink()]
    if folders:
        raise UserError(f"{said} holds a folder lora-tune did not put there ({folders[0]}); {never}. Move it out first")
    if not overwrite:
        raise UserError(f"{said} is not empty; choose another folder or pass --overwrite")
