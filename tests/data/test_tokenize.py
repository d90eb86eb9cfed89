"""Tokenizing: samples too long are truncated or dropped, samples left without a label dropped, each counted."""

from __future__ import annotations

from lora_tune.data.prepare import prepare_data
from lora_tune.data.tokenize import DROPPED_CUT, DROPPED_LONG, DROPPED_NO_LABELS, DROPPED_SAME, TRUNCATED

from helpers import data_config, tokenize_one, write_jsonl


def test_long_samples_truncate_or_drop_are_counted(tmp_path, tokenizer):
    sample, status = tokenize_one(tokenizer, "text", {"text": "word " * 200}, max_seq_len=32)
    assert status == TRUNCATED and len(sample.input_ids) == 32
    assert tokenize_one(tokenizer, "text", {"text": "word " * 200}, max_seq_len=32, long_samples="drop")[1] == DROPPED_LONG
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * 200}, {"text": "short"}])
    prepared = prepare_data(data_config(path, max_seq_len=32, long_samples="drop"), tokenizer)
    assert prepared.stats.dropped_long == 1 and len(prepared.train) == 1


def test_fully_masked_samples_are_dropped_and_counted(tokenizer):
    # The prompt alone fills max_seq_len: after truncation no trainable token is left (counted apart from rows
    # that never had one, so the advice can say to raise --max-seq-len).
    assert tokenize_one(tokenizer, "prompt_completion", {"prompt": "word " * 100, "completion": "x"}, max_seq_len=16)[1] == DROPPED_CUT
    assert tokenize_one(tokenizer, "pretokenized", {"input_ids": [5, 6, 7], "labels": [-100] * 3}, max_seq_len=16)[1] == DROPPED_NO_LABELS
    # ... and long, with every label on the part kept: truncated, not dropped
    assert tokenize_one(tokenizer, "pretokenized", {"input_ids": [5] * 40, "labels": [5] * 40}, max_seq_len=16)[1] == TRUNCATED


def test_bad_pairs_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [
        {"prompt": "Q", "chosen": " same", "rejected": " same"},  # nothing to prefer
        {"prompt": "word " * 100, "chosen": " a", "rejected": " b"},  # the prompt fills --max-seq-len
        {"prompt": "Q", "chosen": " yes", "rejected": " no"},
    ]
    assert tokenize_one(tokenizer, "preference", rows[0], objective="dpo")[1] == DROPPED_SAME
    assert tokenize_one(tokenizer, "preference", rows[1], objective="dpo", max_seq_len=16)[1] == DROPPED_CUT
    assert tokenize_one(tokenizer, "preference", rows[1], objective="dpo", max_seq_len=16, long_samples="drop")[1] == DROPPED_LONG
    prepared = prepare_data(data_config(write_jsonl(tmp_path / "p.jsonl", rows), max_seq_len=16, objective="dpo"), tokenizer)
    assert (prepared.stats.dropped_same, prepared.stats.dropped_cut, prepared.stats.dropped_no_labels, len(prepared.train)) == (1, 1, 0, 1)
    assert (
        "0 dropped with no trainable tokens, 1 dropped with every trainable token past --max-seq-len, 1 pairs dropped with chosen == "
        "rejected" in prepared.stats.summary()
    )
