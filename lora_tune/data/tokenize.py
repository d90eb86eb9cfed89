"""Records -> (input_ids, labels), a batch at a time, as a `datasets.map` function.

Masks are built by construction: a record is rendered as (text, trainable) pieces (its format
decides which), each piece is tokenized on its own and concatenated, so the response is never
found again by matching tokens (trl #1550). EOS is appended with a real label unless the template
already ended the response with it, so the model learns to stop; the first token never carries a
label (nothing precedes it; packed, it would be trained as the previous sample's continuation).
Samples longer than --max-seq-len are truncated or dropped, samples without any label are dropped,
and each row's fate is kept in `status` for the summary.

A sample may hold several sequences (a preference pair's chosen and rejected): they are stored one
after the other, `starts` says where each begins, and each is cut, masked and checked on its own.

A prompt to complete (online RL) is tokenized as the generation will continue it: no EOS, no label,
a long one cut from the left (its end, where the answer starts, is what matters); its row travels
along as JSON (`row`) for the reward functions.
"""

from __future__ import annotations

import json

from lora_tune.data import formats
from lora_tune.data.chat import ChatRenderer
from lora_tune.models.head import IGNORE

KEPT, TRUNCATED, DROPPED_LONG, DROPPED_NO_LABELS, DROPPED_SAME = 0, 1, 2, 3, 4
NO_LABEL = -1  # the `label` of a sample that is not a KTO row


class Tokenize:
    def __init__(self, tokenizer, fmt: str, cfg, source_label: str, option: str = "--data"):
        self.tok = tokenizer
        self.fmt = formats.BY_NAME[fmt]
        self.kind = formats.kind(self.fmt)
        self.train_on_prompt = cfg.train_on_prompt
        self.max_len = cfg.max_seq_len
        self.long = cfg.long_samples
        self.eos = tokenizer.eos_token_id
        self.where = f"{option} {source_label}"
        chat = fmt in ("messages", "sharegpt") or self.kind != "sft"
        self.chat = ChatRenderer(tokenizer, getattr(cfg, "system_message", "auto")) if chat else None

    def _sequences(self, record: dict, where: str, neighbour: dict) -> list[tuple[list[tuple[str, bool]], bool]]:
        """The record's sequences: (pieces, rendered by the chat template) each."""
        if self.kind == "unpaired":
            found = self.fmt.sequences(record, where, self.chat, neighbour)
        elif self.kind == "pairs":
            found = self.fmt.sequences(record, where, self.chat)
        else:
            found = [(self.fmt.pieces(record, where, self.chat), self.chat is not None)]
        return [([(text, trainable) for text, trainable in pieces if text], templated) for pieces, templated in found]

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out = {"input_ids": [], "labels": [], "starts": [], "label": [], "length": [], "status": []}
        wheres = [f"{self.where}: row {i + 1}" for i in indices]
        if self.kind == "prompts":
            return self._prompts(rows, wheres, out)
        if self.fmt.NAME == "pretokenized":
            samples = [[self.fmt.tokens(r, where, len(self.tok))] for r, where in zip(rows, wheres)]
        else:
            # KTO's KL sequence takes the previous row's completion (TRL's rotation within a batch).
            rendered = [self._sequences(r, where, rows[k - 1]) for k, (r, where) in enumerate(zip(rows, wheres))]
            flat = self._tokenize([seq for row in rendered for seq in row])
            samples, at = [], 0
            for row in rendered:
                samples.append(flat[at : at + len(row)])
                at += len(row)
        for row, where, sequences in zip(rows, wheres, samples):
            self._finish(sequences, self.fmt.label(row, where) if self.kind == "unpaired" else None, out)
        return out

    def _prompts(self, rows: list[dict], wheres: list[str], out: dict) -> dict[str, list]:
        out["row"] = []
        for row, where in zip(rows, wheres):
            text, templated = self.fmt.prompt_text(row, where, self.chat)
            ids = self.tok(text, add_special_tokens=not templated)["input_ids"]
            status = KEPT
            if len(ids) > self.max_len:
                status, ids = (DROPPED_LONG, []) if self.long == "drop" else (TRUNCATED, ids[-self.max_len :])
            for key, value in (("input_ids", ids), ("labels", [IGNORE] * len(ids)), ("starts", [0] if ids else [])):
                out[key].append(value)
            out["label"].append(NO_LABEL)
            out["length"].append(len(ids))
            out["status"].append(status)
            out["row"].append(json.dumps(row, default=str))
        return out

    def _tokenize(self, sequences: list[tuple[list[tuple[str, bool]], bool]]) -> list[tuple[list[int], list[int]]]:
        """One tokenizer call per kind of first piece (with the tokenizer's special tokens, or
        without them for chat-rendered text, whose template writes BOS) and one for all the
        others (fast tokenizers batch in Rust), then reassembled sequence by sequence."""
        first = {templated: [p[0][0] for p, t in sequences if p and t == templated] for templated in (False, True)}
        first_ids = {t: iter(self.tok(texts, add_special_tokens=not t)["input_ids"]) if texts else iter(()) for t, texts in first.items()}
        rest = [text for pieces, _ in sequences for text, _ in pieces[1:]]
        rest_ids = iter(self.tok(rest, add_special_tokens=False)["input_ids"]) if rest else iter(())
        out = []
        for pieces, templated in sequences:
            ids: list[int] = []
            labels: list[int] = []
            last_response: list[int] = []
            for k, (_, trainable) in enumerate(pieces):
                piece = next(first_ids[templated]) if k == 0 else next(rest_ids)
                ids += piece
                labels += piece if (trainable or self.train_on_prompt) else [IGNORE] * len(piece)
                last_response = piece if trainable else last_response
            # Chat templates usually end each assistant turn with EOS; otherwise append it, labelled.
            if self.eos not in last_response:
                ids.append(self.eos)
                labels.append(self.eos)
            out.append((ids, labels))
        return out

    def _cut(self, ids: list[int], labels: list[int]) -> tuple[int, list[int], list[int]]:
        """One sequence truncated or dropped to --max-seq-len, its first label masked."""
        status = KEPT
        if len(ids) > self.max_len:
            if self.long == "drop":
                return DROPPED_LONG, [], []
            status, ids, labels = TRUNCATED, ids[: self.max_len], labels[: self.max_len]
        labels = [IGNORE] + list(labels[1:])
        # A sequence whose labels are all masked adds nothing but a 0/0 to the loss (trl #6668).
        if all(label == IGNORE for label in labels):
            return DROPPED_NO_LABELS, [], []
        return status, ids, labels

    def _finish(self, sequences: list[tuple[list[int], list[int]]], label: bool | None, out: dict) -> None:
        cut = [self._cut(ids, labels) for ids, labels in sequences]
        dropped = next((status for status, ids, _ in cut if not ids), None)
        if dropped is None and self.kind == "pairs" and cut[0][1] == cut[1][1]:
            dropped = DROPPED_SAME  # nothing to prefer between two identical answers
        ids, labels, starts = [], [], []
        if dropped is None:
            for _, seq_ids, seq_labels in cut:
                starts.append(len(ids))
                ids += seq_ids
                labels += seq_labels
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["starts"].append(starts)
        out["label"].append(NO_LABEL if label is None else int(label))
        out["length"].append(len(ids))
        out["status"].append(dropped if dropped is not None else max(status for status, _, _ in cut))
