"""Already tokenized: `input_ids`, optional `labels` (-100 where no loss; default: every token) and
optional `attention_mask` (0 marks padding, which is removed)."""

from lora_tune.errors import UserError
from lora_tune.models.head import IGNORE

NAME = "pretokenized"
COLUMNS = ("input_ids",)


def claims(columns: set) -> bool:
    return True


def tokens(record: dict, where: str, vocab_size: int) -> tuple[list[int], list[int]]:
    ids = record.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UserError(f"{where}: 'input_ids' must be a non-empty list of integers")
    if not all(0 <= t < vocab_size for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise UserError(
            f"{where}: token id {bad} is outside the tokenizer's vocabulary (0..{vocab_size - 1}); was it tokenized for another model?"
        )
    labels = record.get("labels")
    if labels is None:
        labels = list(ids)
    elif not isinstance(labels, list) or len(labels) != len(ids):
        raise UserError(f"{where}: 'labels' must be a list as long as 'input_ids' ({len(ids)})")
    else:
        wrong = [t for t in labels if isinstance(t, bool) or not isinstance(t, int) or not (t == IGNORE or 0 <= t < vocab_size)]
        if wrong:
            raise UserError(
                f"{where}: label {wrong[0]!r} is neither a token id of the tokenizer's vocabulary (0..{vocab_size - 1}) nor {IGNORE} "
                "(no loss); was it tokenized for another model?"
            )
    mask = record.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise UserError(f"{where}: 'attention_mask' must be a list as long as 'input_ids' ({len(ids)})")
        keep = [i for i, m in enumerate(mask) if m]
        ids, labels = [ids[i] for i in keep], [labels[i] for i in keep]
    return ids, labels
