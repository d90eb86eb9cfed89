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

A chat row with images (image-text bases) is tokenized on its own: each piece that holds the
template's image placeholders goes through the base's processor, which expands each placeholder to
its image's tokens (`lora_tune.models.processors`), so the row's length counts them before any cut.
Image tokens never carry a label (not even with --train-on-prompt), and a cut never falls inside
them: a row whose images end past --max-seq-len is dropped (--long-samples drop) or refused. The
row keeps its image files and their content hashes (`images`, `image_hashes`).
"""

from __future__ import annotations

import json
from pathlib import Path

from lora_tune.data import formats, images
from lora_tune.data.chat import ChatRenderer
from lora_tune.errors import UserError
from lora_tune.models.head import IGNORE

KEPT, TRUNCATED, DROPPED_LONG, DROPPED_NO_LABELS, DROPPED_SAME = 0, 1, 2, 3, 4
DROPPED_CUT = 5  # truncated to --max-seq-len, and every trainable token lay past the cut
NO_LABEL = -1  # the `label` of a sample that is not a KTO row


class Tokenize:
    def __init__(self, tokenizer, fmt: str, cfg, source_label: str, option: str = "--data", image_text=None, folder: Path | None = None):
        """`image_text`: the base's processor (`lora_tune.models.processors.ImageText`), None for a text
        base, or why it can't load; `folder`: where image paths are relative to."""
        self.tok = tokenizer
        # The processor, or None; why there is none when images can't be trained (said when a row has one).
        self.vision = None if isinstance(image_text, str) else image_text
        self.no_images = image_text if isinstance(image_text, str) else None
        self.folder = folder or Path.cwd()
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
        out = {"input_ids": [], "labels": [], "starts": [], "label": [], "length": [], "status": [], "images": [], "image_hashes": []}
        wheres = [f"{self.where}: row {i + 1}" for i in indices]
        if self.kind == "prompts":
            return self._prompts(rows, wheres, out)
        files = [self._image_files(r, where) for r, where in zip(rows, wheres)]
        if any(files):
            return self._with_images(rows, wheres, files, out)
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
            for ids, _ in sequences:
                self._check_no_stray_image_tokens(ids, False, where)
            self._finish(sequences, self.fmt.label(row, where) if self.kind == "unpaired" else None, out)
        return out

    def _check_no_stray_image_tokens(self, ids: list[int], with_images: bool, where: str) -> None:
        """A row without images whose text holds the model's image token (a literal `<image>`) would
        reach the model as an image without pixels: refused here, naming the row."""
        vision = self.vision
        if with_images or vision is None or vision.image_token_id not in ids:
            return
        raise UserError(
            f"{where}: its text holds the image token {vision.placeholder!r} but the row gives no image; give the image "
            "(an image part, or an 'images' column) or remove the token"
        )

    def _image_files(self, row: dict, where: str) -> list[Path]:
        """The row's image files, checked to exist (a format without images: none)."""
        if not hasattr(self.fmt, "images"):
            if row.get("images"):
                raise UserError(f"{where}: an 'images' column; images train in sft chat data (messages or conversations) only, for now")
            return []
        refs = self.fmt.images(row, where)
        if refs and self.vision is None:
            raise UserError(
                self.no_images or f"{where}: the row has images but --base is a text-only model; use an image-text base or drop the images"
            )
        return [images.resolve(ref, self.folder, where) for ref in refs]

    def _with_images(self, rows: list[dict], wheres: list[str], files: list[list[Path]], out: dict) -> dict:
        """Rows of a batch of which some hold images: those one by one through the processor."""
        for row, where, paths in zip(rows, wheres, files):
            pieces, templated = self._sequences(row, where, row)[0]
            sequence = self._tokenize_images(pieces, templated, paths, where) if paths else self._tokenize([(pieces, templated)])[0]
            self._check_no_stray_image_tokens(sequence[0], bool(paths), where)
            self._finish([sequence], None, out, where)
            out["images"][-1] = [str(p) for p in paths] if out["length"][-1] else []
            out["image_hashes"][-1] = [images.file_hash(p) for p in out["images"][-1]]
        return out

    def _tokenize_images(
        self, pieces: list[tuple[str, bool]], templated: bool, paths: list[Path], where: str
    ) -> tuple[list[int], list[int]]:
        vision = self.vision
        pictures = [images.load(p, where, vision.max_pixels, vision.min_pixels) for p in paths]
        ids: list[int] = []
        labels: list[int] = []
        last_response: list[int] = []
        used = 0
        for k, (text, trainable) in enumerate(pieces):
            n = text.count(vision.placeholder)
            if n:
                piece = vision.expand(text, pictures[used : used + n])
                used += n
            else:
                piece = self.tok(text, add_special_tokens=k == 0 and not templated)["input_ids"]
            ids += piece
            keep = trainable or self.train_on_prompt
            labels += [t if keep and t not in vision.masked_ids else IGNORE for t in piece]
            last_response = piece if trainable else last_response
        if used != len(pictures):
            raise UserError(
                f"{where}: the chat template wrote {used} image placeholder(s) for {len(pictures)} image(s); the base's template "
                "must render image parts (use the checkpoint's own chat template)"
            )
        if self.eos not in last_response:
            ids.append(self.eos)
            labels.append(self.eos)
        return ids, labels

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
            out["images"].append([])
            out["image_hashes"].append([])
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

    def _cut(self, ids: list[int], labels: list[int], where: str = "") -> tuple[int, list[int], list[int]]:
        """One sequence truncated or dropped to --max-seq-len, its first label masked."""
        status, labelled = KEPT, any(label != IGNORE for label in labels[1:])
        if len(ids) > self.max_len:
            if self.long == "drop":
                return DROPPED_LONG, [], []
            if self.vision is not None and any(t in self.vision.masked_ids for t in ids[self.max_len :]):
                raise UserError(
                    f"{where}: its image tokens run past --max-seq-len {self.max_len} (the row is {len(ids)} tokens); raise "
                    "--max-seq-len, lower --max-pixels, or pass --long-samples drop (a cut never falls inside an image)"
                )
            status, ids, labels = TRUNCATED, ids[: self.max_len], labels[: self.max_len]
        labels = [IGNORE] + list(labels[1:])
        # A sequence whose labels are all masked adds nothing but a 0/0 to the loss (trl #6668).
        if all(label == IGNORE for label in labels):
            return (DROPPED_CUT if labelled else DROPPED_NO_LABELS), [], []
        return status, ids, labels

    def _finish(self, sequences: list[tuple[list[int], list[int]]], label: bool | None, out: dict, where: str = "") -> None:
        cut = [self._cut(ids, labels, where) for ids, labels in sequences]
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
        out["images"].append([])
        out["image_hashes"].append([])
