"""Data formats, one small module each: `COLUMNS` (how a source is recognised, after column
mapping) and `pieces(record, where, chat)`, the record as (text, trainable) pieces in order; or,
for already tokenized data, `tokens(record, where)`. Detection tries them in `ORDER`."""

from __future__ import annotations

from lora_tune.data.formats import alpaca, messages, pretokenized, prompt_completion, sharegpt, text
from lora_tune.errors import UserError

ORDER = (pretokenized, messages, sharegpt, alpaca, prompt_completion, text)
ACCEPTED = " | ".join(f"{' + '.join(f.COLUMNS)} ({f.NAME})" for f in ORDER)
BY_NAME = {f.NAME: f for f in ORDER}


def detect(columns, source: str, option: str = "--data"):
    present = set(columns)
    for fmt in ORDER:
        if set(fmt.COLUMNS) <= present and fmt.claims(present):
            return fmt
    raise UserError(
        f"{option}: {source} has columns {sorted(present)}, none of the accepted formats: {ACCEPTED}; "
        "rename them with --data-columns (e.g. instruction=question,output=answer)"
    )
