"""Plain text: `text`; the loss is on every token."""

from lora_tune.data.formats.fields import string

NAME = "text"
COLUMNS = ("text",)


def claims(columns: set) -> bool:
    return True


def pieces(record: dict, where: str, chat) -> list[tuple[str, bool]]:
    return [(string(record, "text", where), True)]
