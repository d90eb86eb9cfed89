"""Tokenizing: samples too long are truncated or dropped, samples left without a label dropped, each counted."""

from __future__ import annotations

from lora_tune.data import prepare_data
from lora_tune.data.tokenize import DROPPED_LONG, DROPPED_NO_LABELS, TRUNCATED

from helpers import data_config, tokenize_one, write_jsonl


def test_long_samples_truncate_or_drop_are_counted(tmp_path, tokenizer):
    sample, status = tokenize_one(tokenizer, "text", {"text": "word " * 200}, max_seq_len=32)
    assert status == TRUNCATED and len(sample.input_ids) == 32
    assert tokenize_one(tokenizer, "text", {"text": "word " * 200}, max_seq_len=32, long_samples="drop")[1] == DROPPED_LONG
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * 200}, {"text": "short"}])
    prepared = prepare_data(data_config(path, max_seq_len=32, long_samples="drop"), tokenizer)
    assert prepared.stats.dropped_long == 1 and len(prepared.train) == 1


def test_fully_masked_samples_are_dropped_and_counted(tokenizer):
    # The prompt alone fills max_seq_len: after truncation no trainable token is left.
    assert (
        tokenize_one(tokenizer, "prompt_completion", {"prompt": "word " * 100, "completion": "x"}, max_seq_len=16)[1] == DROPPED_NO_LABELS
    )
