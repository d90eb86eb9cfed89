"""Prompt / completion: `prompt`, `completion`; the loss is on the completion."""

from lora_tune.data.formats.fields import string

NAME = "prompt_completion"
COLUMNS = ("prompt", "completion")


def claims(columns: set) -> bool:
    return True


def pieces(record: dict, where: str, chat) -> list[tuple[str, bool]]:
    return [(string(record, "prompt", where), False), (string(record, "completion", where), True)]
