"""Data formats, one small module each: `COLUMNS` (how a source is recognised, after column
mapping), `KIND` (what an objective trains on: `sft` rows, preference `pairs`, `unpaired` rows marked
desirable or not, `prompts` to complete; `sft` when absent), and the record as (text, trainable)
pieces in order: `pieces(record, where, chat)` for one sequence, `sequences(...)` for several (a
pair's two), `prompt_text(...)` for a prompt; or, for already tokenized data, `tokens(record, where,
vocab)`. Detection tries them in `ORDER`."""

from __future__ import annotations

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
