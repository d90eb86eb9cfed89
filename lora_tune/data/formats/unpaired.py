"""Unpaired preferences (KTO): `prompt` + `completion` + `label` (true: desirable, false: not), as TRL
writes them; strings are plain text, message lists conversations (as in `preference`). Besides its
own sequence each row carries a second one, its prompt with the previous row's completion (TRL's
rotation): KTO's reference point (the KL term) is measured on such mismatched pairs."""

from __future__ import annotations

from lora_tune.data.formats import preference
from lora_tune.errors import UserError

NAME = "unpaired_preference"
KIND = "unpaired"
COLUMNS = ("prompt", "completion", "label")


def claims(columns: set) -> bool:
    return True


def label(record: dict, where: str) -> bool:
    value = record.get("label")
    if not isinstance(value, bool):
        raise UserError(f"{where}: 'label' must be true (desirable) or false (undesirable), got {value!r}")
    return value


def sequences(record: dict, where: str, chat, neighbour: dict) -> list[tuple[list[tuple[str, bool]], bool]]:
    """This row's sequence, and its prompt with the neighbouring (previous) row's completion (the KL sequence)."""
    if record.get("completion") in (None, "", []):
        raise UserError(f"{where}: 'completion' is missing or empty")
    pair = {"prompt": record.get("prompt"), "chosen": record["completion"], "rejected": neighbour.get("completion") or record["completion"]}
    return preference.sequences(pair, where, chat)
