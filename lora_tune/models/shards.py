"""A model folder's safetensors shards, read without loading them: which files hold the weights (the
index, or the single file), and each file's header (every tensor's dtype, shape and byte range),
checked against the file's size so a truncated or garbage shard is named before anything loads it.
Layer-by-layer loading, the streaming merge and the input checks read shards through here."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from lora_tune.errors import UserError

# safetensors' dtype names (the file format's, https://github.com/huggingface/safetensors).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard, as its header describes it."""

    file: Path
    offset: int  # of its first byte in the file
    nbytes: int
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]


def shard_files(folder: Path) -> list[Path] | None:
    """The safetensors files holding a model's weights, in a stable order; None when the folder has none."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--base: {index} is unreadable or not a safetensors index ({e}); restore it from the model's source") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    return None


def weight_files(folder: Path) -> list[Path]:
    """shard_files, refusing a folder without safetensors weights in one line."""
    files = shard_files(folder)
    if files is None:
        raise UserError(f"--base: {folder} has neither {SINGLE} nor {INDEX}; convert the model to safetensors first")
    return files


def read_header(path: Path) -> dict[str, Entry]:
    """Every tensor of one shard, from its header; refuses a file that is truncated, empty or not
    safetensors, naming it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= length <= min(MAX_HEADER, size - 8):
                raise ValueError("no safetensors header")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        raise UserError(f"--base: {path} is not a readable safetensors file ({e}); re-download or re-convert the model") from None
    entries = {}
    data_start = 8 + length
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            entry = Entry(path, data_start + start, end - start, info["dtype"], tuple(info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"--base: {path} has a malformed header entry for {key}; re-download or re-convert the model") from None
        if entry.offset + entry.nbytes > size:
            raise UserError(
                f"--base: {path} is truncated ({size:,} bytes, but {key} ends at byte {entry.offset + entry.nbytes:,}); "
                "re-download or re-convert the model"
            )
        entries[key] = entry
    return entries


def read_headers(folder: Path) -> dict[str, Entry]:
    """Every tensor of a model folder (all shards), validated; refuses a folder without safetensors."""
    entries: dict[str, Entry] = {}
    for path in weight_files(folder):
        if not path.is_file():
            raise UserError(f"--base: {path} is listed in {INDEX} but missing; re-download the model")
        entries.update(read_header(path))
    return entries


def fingerprint(folder: Path, files: list[Path] | None = None) -> str:
    """What identifies a model's weights, cheaply (no tensor is read): its config.json bytes and, per
    weights file, its name, size and (safetensors) header, each header validated first. `files`:
    other weight files (pickle .bin) to identify by name and size only."""
    h = hashlib.sha256()
    try:
        h.update((folder / "config.json").read_bytes())
    except OSError as e:
        raise UserError(f"--base: {folder / 'config.json'} is unreadable ({e.strerror or e})") from None
    if files is None:
        read_headers(folder)  # refuses a missing, truncated or garbage shard, naming it
        files = shard_files(folder)
        for path in files:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                h.update(f"{path.name}:{path.stat().st_size}:".encode() + f.read(length))
    else:
        for path in files:
            h.update(f"{path.name}:{path.stat().st_size};".encode())
    return h.hexdigest()[:24]


def base_fingerprint(base_path: str, allow_bin: bool) -> str | None:
    """Checks the base's weights before loading and returns what identifies them: its config.json
    and each safetensors file's name, size and header (validated against the file's size, so a
    truncated or garbage shard is named now). A hub id is looked up in the local cache; None when
    it isn't there yet (from_pretrained will download it)."""
    folder = Path(base_path)
    if not folder.is_dir():
        cached = try_to_load_from_cache(base_path, "config.json")
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
        files = shard_files(folder)
        if files is None or not all(p.is_file() for p in files):
            return None  # not all downloaded yet: from_pretrained fetches the rest
    if shard_files(folder) is None:
        bins = sorted(folder.glob("*.bin"))
        if not bins or not allow_bin:
            return None  # the loader names what is missing (or asks for --allow-bin)
        return fingerprint(folder, bins)
    return fingerprint(folder)
