"""Data formats, one small module each: `COLUMNS` (how a source is recognised, after column
mapping), `KIND` (what an objective trains on: `sft` rows, preference `pairs`, `unpaired` rows marked
desirable or not, `prompts` to complete; `sft` when absent), and the record as (text, trainable)
pieces in order: `pieces(record, where, chat)` for one sequence, `sequences(...)` for several (a
pair's two), `prompt_text(...)` for a prompt; or, for already tokenized data, `tokens(record, where,
vocab)`. Detection tries them in `ORDER`."""

from __future__ import annotations

import pyarrow.compute as pc

from lora_tune.data.formats import alpaca, messages, preference, pretokenized, prompt_completion, prompts, sharegpt, text, unpaired
from lora_tune.errors import UserError

ORDER = (pretokenized, preference, unpaired, messages, sharegpt, alpaca, prompt_completion, text, prompts)
ACCEPTED = " | ".join(f"{' + '.join(f.COLUMNS)} ({f.NAME})" for f in ORDER)
BY_NAME = {f.NAME: f for f in ORDER}


def kind(fmt) -> str:
    return getattr(fmt, "KIND", "sft")


def detect(columns, source: str, option: str = "--data"):
    present = set(columns)
    for fmt in ORDER:
        if set(fmt.COLUMNS) <= present and fmt.claims(present):
            return fmt
    raise UserError(
        f"{option}: {source} has columns {sorted(present)}, none of the accepted formats: {ACCEPTED}; "
        "rename them with --data-columns (e.g. instruction=question,output=answer)"
    )


def check_one_format(table, fmt, source: str, option: str = "--data") -> None:
    """A file of alpaca rows followed by chat rows loads as one table of all their columns, each row
    null in the other format's: detection names one format and the other's rows would fail one by one
    with a missing field. Said as what it is, with the first row of each format. `table`: the source's
    Arrow table (null counts are metadata: a source of one format costs nothing here)."""
    if not any(table.column(c).null_count for c in fmt.COLUMNS):
        return

    def first(columns, otherwise=()) -> int:
        mask = None
        for c in columns:
            valid = pc.is_valid(table.column(c))
            mask = valid if mask is None else pc.and_(mask, valid)
        for c in otherwise:  # and not a row of `fmt`
            mask = pc.and_(mask, pc.is_null(table.column(c)))
        return pc.index(mask, True).as_py()

    present = set(table.column_names)
    mine = first(fmt.COLUMNS)
    for other in ORDER:
        if other is fmt or not set(other.COLUMNS) <= present or set(other.COLUMNS) <= set(fmt.COLUMNS):
            continue
        theirs = first(other.COLUMNS, [c for c in fmt.COLUMNS if c not in other.COLUMNS])
        if mine >= 0 and theirs >= 0:
            found = sorted([(mine, fmt), (theirs, other)], key=lambda pair: pair[0])
            said = ", ".join(f"{f.NAME} rows ({', '.join(f.COLUMNS)}) from row {row + 1}" for row, f in found)
            raise UserError(
                f"{option}: {source} mixes data formats: {said}; a source holds one format: put each in its own file and give "
                "them all to --data"
            )
