"""Records -> (input_ids, labels), a batch at a time, as a `datasets.map` function.

Masks are built by construction: a record is rendered as (text, trainable) pieces (its format
decides which), each piece is tokenized on its own and concatenated, so the response is never
found again by matching tokens (trl #1550). EOS is appended with a real label unless the template
already ended the response with it, so the model learns to stop; the first token never carries a
label (nothing precedes it; packed, it would be trained as the previous sample's continuation).
Samples longer than --max-seq-len are truncated or dropped, samples without any label are dropped,
and each row's fate is kept in `status` for the summary.
"""

from __future__ import annotations

from lora_tune.data import formats
from lora_tune.data.chat import ChatRenderer
from lora_tune.loss import IGNORE

KEPT, TRUNCATED, DROPPED_LONG, DROPPED_NO_LABELS = 0, 1, 2, 3


class Tokenize:
    def __init__(self, tokenizer, fmt: str, cfg, source_label: str, option: str = "--data"):
        self.tok = tokenizer
        self.fmt = formats.BY_NAME[fmt]
        self.train_on_prompt = cfg.train_on_prompt
        self.max_len = cfg.max_seq_len
        self.long = cfg.long_samples
        self.eos = tokenizer.eos_token_id
        self.where = f"{option} {source_label}"
        self.chat = ChatRenderer(tokenizer, getattr(cfg, "system_message", "auto")) if fmt in ("messages", "sharegpt") else None
        # Chat templates write BOS themselves; plain text gets the tokenizer's own special tokens once.
        self.specials_on_first = self.chat is None

    def _pieces(self, record: dict, where: str) -> list[tuple[str, bool]]:
        return [(text, trainable) for text, trainable in self.fmt.pieces(record, where, self.chat) if text]

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = {"input_ids": [], "labels": [], "length": [], "status": []}
        if self.fmt.NAME == "pretokenized":
            samples = [self.fmt.tokens(r, f"{self.where}: row {i + 1}", len(self.tok)) for r, i in zip(rows, indices)]
        else:
            samples = self._tokenize([self._pieces(r, f"{self.where}: row {i + 1}") for r, i in zip(rows, indices)])
        for ids, labels in samples:
            self._finish(ids, labels, out)
        return out

    def _tokenize(self, all_pieces: list[list[tuple[str, bool]]]) -> list[tuple[list[int], list[int]]]:
        """One tokenizer call for every first piece and one for all the others (fast tokenizers
        batch in Rust), then reassembled row by row."""
        first = [p[0][0] for p in all_pieces if p]
        rest = [text for p in all_pieces for text, _ in p[1:]]
        first_ids = iter(self.tok(first, add_special_tokens=self.specials_on_first)["input_ids"]) if first else iter(())
        rest_ids = iter(self.tok(rest, add_special_tokens=False)["input_ids"]) if rest else iter(())
        samples = []
        for pieces in all_pieces:
            ids: list[int] = []
            labels: list[int] = []
            last_response: list[int] = []
            for k, (_, trainable) in enumerate(pieces):
                piece = next(first_ids) if k == 0 else next(rest_ids)
                ids += piece
                labels += piece if (trainable or self.train_on_prompt) else [IGNORE] * len(piece)
                last_response = piece if trainable else last_response
            # Chat templates usually end each assistant turn with EOS; otherwise append it, labelled.
            if self.eos not in last_response:
                ids.append(self.eos)
                labels.append(self.eos)
            samples.append((ids, labels))
        return samples

    def _finish(self, ids: list[int], labels: list[int], out: dict) -> None:
        status = KEPT
        if len(ids) > self.max_len:
            if self.long == "drop":
                status, ids, labels = DROPPED_LONG, [], []
            else:
                status, ids, labels = TRUNCATED, ids[: self.max_len], labels[: self.max_len]
        if ids:
            labels = [IGNORE] + list(labels[1:])
            # A sample whose labels are all masked adds nothing but a 0/0 to the loss (trl #6668).
            if all(label == IGNORE for label in labels):
                status, ids, labels = DROPPED_NO_LABELS, [], []
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["status"].append(status)
