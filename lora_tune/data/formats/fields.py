"""Reading a record's fields: each format's pieces come from these, with the row named on failure."""

from __future__ import annotations

from lora_tune.errors import UserError


def string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise UserError(f"{where}: '{key}' must be a string (got {type(value).__name__})")
    return value
