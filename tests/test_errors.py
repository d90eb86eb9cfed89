"""The one-line error helpers."""

from __future__ import annotations

from lora_tune.errors import did_you_mean, first_line


def test_first_line_of_an_exception_even_an_empty_one():
    assert first_line(ValueError("bad thing\nand details")) == "bad thing"
    assert first_line(ValueError("  \n  ")) == "ValueError"  # no IndexError on an empty message
    assert first_line(OSError()) == "OSError"


def test_did_you_mean_suggests_only_close_words():
    assert did_you_mean("max_seq_length", ["max_seq_len", "rank"]) == " (did you mean max_seq_len?)"
    assert did_you_mean("zzz", ["max_seq_len", "rank"]) == ""
