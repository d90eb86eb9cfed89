"""Tokenize once, keep it: each source's tokenized samples live in an Arrow folder on disk, keyed by
everything that changes tokens or masks (the data's bytes, the tokenizer, the chat template, the
format and column mapping, and the options that cut or mask samples). A second run, a resume, or a
run with another output folder over the same data memory-maps it instead of tokenizing again.

Several processes (ranks of one job, two jobs at once) build a source at most once: the first takes
a lock on its key, the others wait on it and then read what it wrote. The folder appears complete
or not at all (built under a temporary name, renamed into place).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import datasets
import datasets.config

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
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another process building the same key: wait for it
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_or_build(root: Path | None, key: str, build):
    """(dataset, meta) for `key`: read from `root` when there, else `build(workdir)` -> (dataset,
    meta) writes its Arrow files under `workdir` and is saved to `root` first. `root` None: no
    cache, `build(None)` keeps everything in memory."""
    if root is None:
        return build(None)
    folder = root / key
    if not (folder / "meta.json").is_file():
        with locked(root / f"{key}.lock"):
            if not (folder / "meta.json").is_file():
                started = time.perf_counter()
                tmp = root / f".{key}.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    dataset, meta = build(tmp / "work")
                    dataset.save_to_disk(str(tmp / "data"))
                    del dataset
                    shutil.rmtree(tmp / "work", ignore_errors=True)
                    (tmp / "meta.json").write_text(json.dumps(meta))  # written last: its presence marks completeness
                    shutil.rmtree(folder, ignore_errors=True)
                    os.replace(tmp, folder)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                log.info("data: tokenized %s in %.1f s, cached in %s", meta["source"], time.perf_counter() - started, folder)
    meta = json.loads((folder / "meta.json").read_text())
    data = folder / "data"
    if not json.loads((data / "state.json").read_text())["_data_files"]:
        # `save_to_disk` writes no Arrow file for zero rows and `load_from_disk` can't read that back
        features = datasets.Features.from_dict(json.loads((data / "dataset_info.json").read_text())["features"])
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features), meta
    return datasets.load_from_disk(str(data)), meta
