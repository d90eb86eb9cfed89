"""Plain text: `text`; the loss is on every token."""

NAME = "text"
COLUMNS = ("text",)


def claims(columns: set) -> bool:
    return True


def pieces(record: dict, where: str, chat) -> list[tuple[str, bool]]:
    from lora_tune.data.formats import string

    return [(string(record, "text", where), True)]
