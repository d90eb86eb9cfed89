"""The exceptions the CLI turns into one line: `UserError` ("the user gave us something we can't
use": `error: ...`, exit code 2) and `TrainingStopped` (a run that ended early but cleanly, with its
own exit code). Anything else is a bug and keeps its traceback."""

import difflib
import os
import signal
import threading
from contextlib import contextmanager

# Every character str.splitlines() breaks on, written as its escape: a quoted key or value can't
# turn the one `error:` line into two.
ESCAPED_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


class UserError(Exception):
    """Bad input: the message names the culprit and how to fix it.

    exit_code 2 means the input was wrong; 1 means the machine was (full disk, I/O error).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message.translate(ESCAPED_BREAKS))  # one line, whatever the input it quotes holds
        self.exit_code = exit_code


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, for an `error:` line (its type when it says nothing)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class TrainingStopped(Exception):
    """The run ended early but cleanly (signal, repeated NaN, a checkpoint that could not be
    written, out of memory); carries the exit code and whether it is an error or a requested stop."""

    def __init__(self, message: str, exit_code: int, label: str = "stopped"):
        super().__init__(message)
        self.exit_code = exit_code
        self.label = label


@contextmanager
def sigterm_stops(doing: str, outcome: str):
    """While the block runs, SIGTERM raises TrainingStopped (exit 143: "stopped by SIGTERM while
    DOING; OUTCOME") instead of ending the process on the spot, so the block's `finally` clauses
    remove what it had half written. Only in the main thread of the process that entered it
    (forked workers keep the default), and never where SIGTERM is ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    owner = os.getpid()

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        if os.getpid() != owner:  # a forked worker (datasets' tokenizing pool) being terminated: die as usual
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise TrainingStopped(f"stopped by SIGTERM while {doing}; {outcome}", 143)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
