"""Tokenize once, keep it: each source's tokenized samples live in an Arrow folder on disk, keyed by
everything that changes tokens or masks (the data's bytes, the tokenizer, the chat template, the
format and column mapping, and the options that cut or mask samples). A second run, a resume, or a
run with another output folder over the same data memory-maps it instead of tokenizing again.

Several processes (ranks of one job, two jobs at once) build a source at most once: the first takes
a lock on its key, the others wait on it and then read what it wrote. The folder appears complete
or not at all (built under a temporary name, renamed into place); one left by a killed builder is
recognised by its free lock and removed. A damaged entry is built again; a cache location that
can't be written (read-only, full) means tokenizing in memory for that run, said once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import datasets
import datasets.config
import xxhash

from lora_tune.errors import first_line, sigterm_stops

log = logging.getLogger("lora_tune")
VERSION = 2  # bump when what is cached changes meaning (2: samples hold sequence starts and a KTO label)


def cache_root(cfg) -> Path:
    if getattr(cfg, "data_cache_dir", None):
        return Path(cfg.data_cache_dir).expanduser()
    return Path(datasets.config.HF_DATASETS_CACHE) / "lora_tune"


def tokenizer_hash(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, str(tokenizer.chat_template)]).encode())
    return h.hexdigest()


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps({"version": VERSION, **parts}, sort_keys=True, default=str).encode()).hexdigest()[:24]


@contextmanager
def locked(path: Path, blocking: bool = True):
    """An exclusive flock on `path` (created): held by the one process building a key. Yields
    False instead when `blocking` is off and another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))  # blocking: another process builds it, wait
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_dead_builds(root: Path, held: str) -> list[Path]:
    """Temporary build folders (`.KEY.tmp-PID`) whose builder is gone: a live builder holds its key's
    lock for as long as its folder exists, so a folder whose lock can be taken (or whose lock this
    process holds: `held`) was left by a process that was killed (SIGKILL, power loss). Removed;
    returned."""
    removed = []
    for tmp in root.glob(".*.tmp-*"):
        key = tmp.name[1:].split(".tmp-")[0]
        if key == held:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
            continue
        with locked(root / f"{key}.lock", blocking=False) as free:
            if free:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    if removed:
        log.info("data: removed %d unfinished cache build(s) left by processes that were killed", len(removed))
    return removed


CHECKSUM_CHUNK = 1 << 26  # 64 MiB: hashed in parallel, the file's checksum made of the chunks' digests


def checksums(paths: list[Path]) -> dict[str, str]:
    """File name -> xxh3-64 checksum (the hash datasets itself depends on) of each file's bytes,
    memory-mapped and hashed chunk by chunk on every core (xxhash lets go of the GIL): 0.06 s for
    the 853 MiB cache of 200,000 long-tail rows on 2 cores, 3% of reading that entry back."""
    tasks = []
    with contextlib.ExitStack() as stack:
        for path in paths:
            size = path.stat().st_size
            if size == 0:
                tasks.append((path.name, None))
                continue
            f = stack.enter_context(open(path, "rb"))
            view = memoryview(stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)))
            stack.callback(view.release)
            tasks += [(path.name, view[i : i + CHECKSUM_CHUNK]) for i in range(0, size, CHECKSUM_CHUNK)]
        with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8))) as pool:
            digests = list(pool.map(lambda task: xxhash.xxh3_64(task[1] if task[1] is not None else b"").hexdigest(), tasks))
        for _, chunk in tasks:
            if chunk is not None:
                chunk.release()
    joined: dict[str, list[str]] = {}
    for (name, _), digest in zip(tasks, digests):
        joined.setdefault(name, []).append(digest)
    return {name: xxhash.xxh3_64(" ".join(parts).encode()).hexdigest() for name, parts in joined.items()}


def read_entry(folder: Path):
    """(dataset, meta) of a complete cache entry, checked: meta, Arrow files of the sizes and
    checksums written (a flipped byte under a valid Arrow footer reads back as other tokens), the
    columns and the row count the build recorded. Raises whatever a damaged entry raises."""
    meta = json.loads((folder / "meta.json").read_text())
    data = folder / "data"
    if "checksums" not in meta:
        raise ValueError("written without checksums (by an earlier lora-tune)")
    for name, size in meta.get("files", {}).items():
        if (data / name).stat().st_size != size:
            raise ValueError(f"{name} is {(data / name).stat().st_size:,} bytes, {size:,} when written")
    found = checksums([data / name for name in meta.get("files", {})])
    damaged = sorted(name for name, digest in found.items() if digest != meta["checksums"].get(name))
    if damaged:
        raise ValueError(f"{damaged[0]} does not have the checksum it was written with")
    if not json.loads((data / "state.json").read_text())["_data_files"]:
        # `save_to_disk` writes no Arrow file for zero rows and `load_from_disk` can't read that back
        features = datasets.Features.from_dict(json.loads((data / "dataset_info.json").read_text())["features"])
        dataset = datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    else:
        dataset = datasets.load_from_disk(str(data))
    missing = {"input_ids", "labels", "starts", "label", "length"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"no column {sorted(missing)[0]!r}")
    stats = meta["stats"]
    kept = stats["rows"] - stats["dropped_long"] - stats["dropped_no_labels"] - stats["dropped_same"] - stats.get("dropped_cut", 0)
    if len(dataset) != kept:
        raise ValueError(f"{len(dataset)} rows, not the {kept} written")
    return dataset, meta


def unusable(error: OSError) -> bool:
    """A cache location that can't take files: read-only, no permission, full, over quota, a file
    where the folder should be, or a lock file that is a symbolic link (never opened through)."""
    return error.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ELOOP, errno.ENOTDIR, errno.EEXIST)


_said_in_memory: set[str] = set()


def load_or_build(root: Path | None, key: str, build, label: str = "the data"):
    """(dataset, meta) for `key`: read from `root` when there, else `build(workdir)` -> (dataset,
    meta) writes its Arrow files under `workdir` and is saved to `root` first. `root` None: no
    cache, `build(None)` keeps everything in memory.

    A damaged entry (truncated, garbage, written by another library version) is built again, with
    a log line; a cache location that is read-only or full is said once, and the data is
    tokenized in memory for this run. SIGTERM while tokenizing removes the unfinished build
    folder and stops the run (exit 143); a build killed outright (SIGKILL) leaves one, which the
    next build removes."""
    with sigterm_stops(f"tokenizing {label}", "nothing of it was cached. Run the same command again") as stop:
        if root is None:
            return build(None)
        folder = root / key
        damaged = None
        if (folder / "meta.json").is_file():
            try:
                return read_entry(folder)
            except Exception as e:  # noqa: BLE001 - anything a damaged entry raises: it is rebuilt
                damaged = e
        try:
            root.mkdir(parents=True, exist_ok=True)
            with locked(root / f"{key}.lock"):
                if damaged is None and (folder / "meta.json").is_file():
                    try:
                        return read_entry(folder)  # another process built it while we waited
                    except Exception as e:  # noqa: BLE001 - anything a damaged entry raises: it is rebuilt
                        damaged = e
                if damaged is not None:
                    log.warning(
                        "data: the cached copy of %s in %s is unreadable (%s); tokenizing it again", label, folder, first_line(damaged)
                    )
                remove_dead_builds(root, key)
                return build_entry(root, key, build, stop.check)
        except OSError as e:
            if not unusable(e):
                raise
            if str(root) not in _said_in_memory:
                _said_in_memory.add(str(root))
                log.warning(
                    "data: the cache folder %s can't be written (%s); tokenizing in memory for this run (choose another "
                    "--data-cache-dir, or --no-data-cache to silence this)",
                    root,
                    e.strerror or e,
                )
            return build(None)


def build_entry(root: Path, key: str, build, before_commit=lambda: None):
    """Build `key` under a temporary name and rename it into place (its meta.json written last);
    `before_commit` may still stop it (a SIGTERM that came during the build)."""
    folder = root / key
    started = time.perf_counter()
    tmp = root / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dataset, meta = build(tmp / "work")
        dataset.save_to_disk(str(tmp / "data"))
        del dataset
        shutil.rmtree(tmp / "work", ignore_errors=True)
        arrows = sorted((tmp / "data").glob("*.arrow"))
        meta["files"] = {p.name: p.stat().st_size for p in arrows}
        meta["checksums"] = checksums(arrows)
        (tmp / "meta.json").write_text(json.dumps(meta))  # written last: its presence marks completeness
        shutil.rmtree(folder, ignore_errors=True)
        before_commit()
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("data: tokenized %s in %.1f s, cached in %s", meta["source"], time.perf_counter() - started, folder)
    return read_entry(folder)
