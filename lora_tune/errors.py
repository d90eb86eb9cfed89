"""The one exception type that means "the user gave us something we can't use".

The CLI turns it into a single `error: ...` line and exit code 2; anything else is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the culprit and how to fix it.

    exit_code 2 means the input was wrong; 1 means the machine was (full disk, I/O error).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
