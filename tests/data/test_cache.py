"""The tokenized cache: a second run reads it without tokenizing, anything that changes tokens or
masks misses it, processes share one build, an empty result reads back as empty."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

import lora_tune.data.prepare as data_prepare
from lora_tune.data import sources
from lora_tune.data.prepare import prepare_data
from lora_tune.errors import UserError
from lora_tune.models.loading import load_tokenizer

from helpers import data_config, fast_train_args, run_cli, tmpfs, write_jsonl


def test_the_cache_is_hit_by_a_second_run_and_missed_when_anything_changes(tmp_path, tokenizer, tiny_model_no_template, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": f"cached {i}"} for i in range(10)])
    options = dict(data_cache_dir=str(tmp_path / "cache"))
    first = prepare_data(data_config(path, **options), tokenizer)
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1

    def no_tokenizing(*a, **k):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(data_prepare, "Tokenize", no_tokenizing)
    second = prepare_data(data_config(path, **options), tokenizer)  # another run (any output folder, or a resume)
    assert [s.input_ids for s in second.train] == [s.input_ids for s in first.train] and second.fingerprint == first.fingerprint
    monkeypatch.undo()
    changes = [
        data_config(path, max_seq_len=64, **options),
        data_config(path, train_on_prompt=True, **options),
        data_config(path, long_samples="drop", **options),
    ]
    for changed in changes:
        prepare_data(changed, tokenizer)
    prepare_data(data_config(path, **options), load_tokenizer(str(tiny_model_no_template)))  # another template
    write_jsonl(path, [{"text": f"changed {i}"} for i in range(10)])
    prepare_data(data_config(path, **options), tokenizer)
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1 + len(changes) + 2
    assert not list((tmp_path / "cache").glob(".*tmp*"))


def test_processes_share_one_build_of_a_source(tmp_path, tiny_model):
    """Two processes at once (as the ranks of a job): one tokenizes, the other waits and reads it."""
    path = write_jsonl(tmp_path / "s.jsonl", [{"text": f"shared {i}"} for i in range(200)])
    script = (
        "import sys, logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from lora_tune.config import TrainConfig; from lora_tune.data.prepare import prepare_data; from lora_tune.models.loading "
        "import load_tokenizer\n"
        f"cfg = TrainConfig(base='b', data={str(path)!r}, output_dir='o', data_cache_dir={str(tmp_path / 'cache')!r})\n"
        f"print(len(prepare_data(cfg, load_tokenizer({str(tiny_model)!r})).train))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert [out.strip() for out, _ in outputs] == ["200", "200"]
    assert sum(err.count("data: tokenized") for _, err in outputs) == 1


def test_a_source_with_no_usable_sample_is_refused_also_from_the_cache(tmp_path, tokenizer):
    # Nothing survives: the cache holds zero rows, which must read back as zero rows, not crash.
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "word " * 100, "completion": "x"}] * 3)
    for attempt in ("built", "cached"):
        with pytest.raises(
            UserError, match=r"^--data: no usable samples .*3 dropped with every trainable token past --max-seq-len\); raise --max-seq-len"
        ) as e:
            prepare_data(data_config(path, max_seq_len=16, data_cache_dir=str(tmp_path / "cache")), tokenizer)
        # --long-samples truncate is in effect (the default): the advice is not to pass it again
        assert "--long-samples" not in str(e.value) and "response begins past it" in str(e.value)
        assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1, attempt


def texts(prepared, tokenizer) -> list[str]:
    return sorted(tokenizer.decode(s.input_ids, skip_special_tokens=True) for s in prepared.train)


def test_a_file_rewritten_with_the_same_size_and_mtime_is_read_anew(tmp_path, tokenizer):
    """`cp -p`, `rsync -t` and `tar -x` leave a new file with the old size and mtime: the rows
    trained on are the new ones, and the old ones are never stored under the new content's key."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"old row {i}"} for i in range(6)])
    options = dict(data_cache_dir=str(tmp_path / "cache"))
    assert texts(prepare_data(data_config(path, **options), tokenizer), tokenizer) == [f"old row {i}" for i in range(6)]
    stat = path.stat()
    write_jsonl(path, [{"text": f"new row {i}"} for i in range(6)])  # same length
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert texts(prepare_data(data_config(path, **options), tokenizer), tokenizer) == [f"new row {i}" for i in range(6)]
    path.touch()  # and what was cached under the new content's key is the new rows
    assert texts(prepare_data(data_config(path, **options), tokenizer), tokenizer) == [f"new row {i}" for i in range(6)]
    assert texts(prepare_data(data_config(path, data_cache=False), tokenizer), tokenizer) == [f"new row {i}" for i in range(6)]


def damage(folder: Path, how: str) -> None:
    arrow = next((folder / "data").glob("*.arrow"))
    if how == "truncated arrow":
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    elif how == "corrupted buffers":  # a token id changed inside the data, the Arrow file still valid
        raw = bytearray(arrow.read_bytes())
        ids = datasets.load_from_disk(str(folder / "data"))[0]["input_ids"]
        at = raw.index(struct.pack(f"<{len(ids)}i", *ids))
        raw[at + 4 : at + 8] = struct.pack("<i", ids[1] + 1)  # the second token of the first sample, another real id
        arrow.write_bytes(bytes(raw))
    elif how == "garbage arrow":
        arrow.write_bytes(os.urandom(arrow.stat().st_size))
    elif how == "empty meta":
        (folder / "meta.json").write_text("")
    elif how == "other library version":  # a state.json this version of datasets can't read
        (folder / "data" / "state.json").write_text('{"_data_files": [{"filename": "gone.arrow"}]}')


@pytest.mark.parametrize("how", ["truncated arrow", "corrupted buffers", "garbage arrow", "empty meta", "other library version"])
def test_a_damaged_cache_entry_is_built_again_with_one_line(how, tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(8)])
    options = dict(data_cache_dir=str(tmp_path / "cache"))
    want = [s.input_ids for s in prepare_data(data_config(path, **options), tokenizer).train]
    (entry,) = [p.parent for p in (tmp_path / "cache").glob("*/meta.json")]
    damage(entry, how)
    logger = logging.getLogger("lora_tune")  # caplog's handler on it, not propagating (as the CLI sets it up): each record once
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="lora_tune"):
            again = prepare_data(data_config(path, **options), tokenizer)
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate
    assert [s.input_ids for s in again.train] == want
    (line,) = [r.message for r in caplog.records if "unreadable" in r.message]
    assert line.startswith(f"data: the cached copy of {path} in {entry} is unreadable (") and line.endswith("); tokenizing it again")
    assert [s.input_ids for s in prepare_data(data_config(path, **options), tokenizer).train] == want  # and it is good now


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_a_cache_folder_that_cant_be_written_means_tokenizing_in_memory_said_once(kind, tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i} " + "word " * 40} for i in range(400)])
    disk = tmp_path / "disk"
    with tmpfs(disk, size="64k" if kind == "full" else "1m", read_only=kind == "read-only"):
        args = fast_train_args(tiny_model, data, tmp_path / "run", max_steps=1, data_cache_dir=disk / "cache", eval_data=data)
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
        assert err.count("can't be written") == 1 and "tokenizing in memory for this run" in err, err
        assert "Traceback" not in err
        assert not list(disk.rglob(".*tmp*"))


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_folder_that_is_a_file_means_tokenizing_in_memory(where, tmp_path, tokenizer, capsys):
    (tmp_path / "file").write_text("mine")
    cache = tmp_path / "file" if where == "a file" else tmp_path / "file" / "cache"
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(4)])
    assert len(prepare_data(data_config(path, data_cache_dir=str(cache)), tokenizer).train) == 4
    assert (tmp_path / "file").read_text() == "mine"


def test_the_unfinished_build_of_a_killed_process_is_removed(tmp_path, tokenizer):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = cache / ".0123456789abcdef01234567.tmp-999999"  # its lock is free: the builder is gone
    (dead / "work").mkdir(parents=True)
    (dead / "work" / "tokens.arrow").write_bytes(b"half")
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(4)])
    prepare_data(data_config(path, data_cache_dir=str(cache)), tokenizer)
    assert not dead.exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_the_empty_file_check_reads_one_block_not_the_file(tmp_path):
    """A 400 MB data file: the check that it is not empty costs a block of memory, not the file."""
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:  # sparse: cheap to make, as costly to read into memory as a real one
        f.write(b'{"text": "x"}\n')
        f.truncate(400 * 2**20)
    blank = tmp_path / "blank.jsonl"
    with open(blank, "wb") as f:
        f.truncate(64 * 2**20)
    f_blank = blank.with_suffix(".spaces.jsonl")
    f_blank.write_bytes(b" \n" * 40_000 + b'{"text": "late"}\n')  # content after the first block still counts
    script = (
        "import resource, sys\n"
        "from lora_tune.data.sources import Source, local_files\n"
        "def peak(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024\n"
        "before = peak()\n"
        f"local_files(Source({str(big)!r}))\n"
        "print((peak() - before) / 2**20)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown = float(proc.stdout.split()[-1])
    print(f"peak RSS growth of the empty-file check on a 400 MB file: {grown:.1f} MiB")
    assert grown <= 20, grown
    assert sources.is_blank(f_blank) is False
    with open(blank, "wb") as f:
        f.write(b" \n\t" * 1000)
    with pytest.raises(UserError, match="is empty; it needs at least one sample"):
        sources.local_files(sources.Source(str(blank)))
