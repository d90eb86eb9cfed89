"""The tokenized cache: a second run reads it without tokenizing, anything that changes tokens or
masks misses it, processes share one build, an empty result reads back as empty."""

from __future__ import annotations

import subprocess
import sys

import pytest

import lora_tune.data as data
from lora_tune.data import prepare_data
from lora_tune.errors import UserError
from lora_tune.model_loading import load_tokenizer

from helpers import data_config, write_jsonl


def test_the_cache_is_hit_by_a_second_run_and_missed_when_anything_changes(tmp_path, tokenizer, tiny_model_no_template, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": f"cached {i}"} for i in range(10)])
    options = dict(data_cache_dir=str(tmp_path / "cache"))
    first = prepare_data(data_config(path, **options), tokenizer)
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1

    def no_tokenizing(*a, **k):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(data, "Tokenize", no_tokenizing)
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
        "from lora_tune.config import TrainConfig; from lora_tune.data import prepare_data; from lora_tune.model_loading "
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
        with pytest.raises(UserError, match=r"^--data: no usable samples .*3 dropped with no trainable tokens\); raise --max-seq-len"):
            prepare_data(data_config(path, max_seq_len=16, data_cache_dir=str(tmp_path / "cache")), tokenizer)
        assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1, attempt
