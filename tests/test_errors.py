"""The one-line error helpers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from lora_tune.errors import TrainingStopped, did_you_mean, first_line, sigterm_stops


def test_first_line_of_an_exception_even_an_empty_one():
    assert first_line(ValueError("bad thing\nand details")) == "bad thing"
    assert first_line(ValueError("  \n  ")) == "ValueError"  # no IndexError on an empty message
    assert first_line(OSError()) == "OSError"


def test_did_you_mean_suggests_only_close_words():
    assert did_you_mean("max_seq_length", ["max_seq_len", "rank"]) == " (did you mean max_seq_len?)"
    assert did_you_mean("zzz", ["max_seq_len", "rank"]) == ""


def sigterm_now():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handler runs at the next bytecode boundary of the main thread


def test_sigterm_stops_the_block_through_a_library_that_catches_exceptions():
    """The handler raises a BaseException: a library's `except Exception` around the signal (datasets'
    map retrying, cleaning up) does not take it for its own error and carry on."""
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM while tokenizing x; nothing cached") as stopped:
        with sigterm_stops("tokenizing x", "nothing cached"):
            try:
                sigterm_now()
            except Exception:  # noqa: BLE001 - what a library does
                pytest.fail("a library's `except Exception` caught the stop")
    assert stopped.value.exit_code == 143


def test_sigterm_stops_the_block_whatever_becomes_of_its_exception():
    """Swallowed (an exception raised in a finalizer is ignored by Python; a library may catch
    everything) or replaced by a library's own error on the way out, the stop holds: at the block's
    next check, before it commits, or at its end; and the SIGTERM handler is restored."""
    before = signal.getsignal(signal.SIGTERM)
    committed = []
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM while merging"):
        with sigterm_stops("merging", "nothing was written") as stop:
            try:
                sigterm_now()
            except BaseException:  # noqa: BLE001 - swallowed
                pass
            stop.check()
            committed.append(True)
    assert not committed and signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM while merging"):
        with sigterm_stops("merging", "nothing was written"):
            try:
                sigterm_now()
            except BaseException as e:  # noqa: BLE001 - a library wraps it in its own error
                raise RuntimeError("pool terminated") from e
    with pytest.raises(TrainingStopped, match="stopped by SIGTERM while merging"):
        with sigterm_stops("merging", "nothing was written"):
            try:
                sigterm_now()
            except BaseException:  # noqa: BLE001 - swallowed, no check: the block's end stops it
                pass
    with sigterm_stops("merging", "nothing was written") as stop:
        stop.check()  # no signal: nothing happens
