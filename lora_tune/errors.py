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


class Terminated(BaseException):
    """What the SIGTERM handler of `sigterm_stops` raises: not an Exception, so that no library's
    `except Exception` (datasets' map, a retry loop) takes it for an error of its own and goes on."""


class SigtermStop:
    """The state of a `sigterm_stops` block: whether SIGTERM came, and the stop it turns into."""

    def __init__(self, doing: str, outcome: str):
        self.fired = False
        self.stopped = TrainingStopped(f"stopped by SIGTERM while {doing}; {outcome}", 143)

    def check(self) -> None:
        """Raise the stop if SIGTERM came, even if what it raised was swallowed: called before the
        block commits its work (renames a finished build into place), so the message stays true."""
        if self.fired:
            raise self.stopped


@contextmanager
def sigterm_stops(doing: str, outcome: str):
    """While the block runs, SIGTERM stops it with TrainingStopped (exit 143: "stopped by SIGTERM
    while DOING; OUTCOME") instead of ending the process on the spot, so the block's `finally`
    clauses remove what it had half written. The handler raises `Terminated` (a BaseException) and
    also records the signal, so the stop holds whatever happens to that exception on its way out:
    wrapped by a library's error, or swallowed where Python ignores exceptions (a finalizer) or by a
    library that catches everything, in which case the block stops at its next `check()` or at its
    end. Only in the main thread of the process that entered it (forked workers keep the default),
    and never where SIGTERM is ignored. Yields the SigtermStop."""
    state = SigtermStop(doing, outcome)
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield state
        return
    owner = os.getpid()

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        if os.getpid() != owner:  # a forked worker (datasets' tokenizing pool) being terminated: die as usual
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        state.fired = True
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield state
    except BaseException:
        if state.fired:  # the signal's exception, or whatever a library turned it into
            raise state.stopped from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    state.check()
