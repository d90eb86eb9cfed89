"""Data stage: load records with `datasets`, detect their format, tokenize with loss masks, batch.

Masks are built by construction: the prompt and the response are tokenized as separate pieces and
concatenated, so we never have to find the response again by matching tokens (trl #1550). EOS is
appended with a real label so the model learns to stop; padding is hidden by the attention mask
and by -100 labels on pad positions only, never by comparing ids with the pad id (trl #1623).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_tune.errors import UserError

IGNORE = -100
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
# Used for `messages` data when the tokenizer has no chat template (documented in the README).
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}### Assistant:\n{{ message['content'] }}{{ eos_token }}\n\n"
    "{% elif message['role'] == 'user' %}### User:\n{{ message['content'] }}\n\n"
    "{% else %}### System:\n{{ message['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
FORMATS = {
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
ACCEPTED = "text | instruction/input/output (alpaca) | messages (chat) | prompt/completion"
ROLES = ("system", "user", "assistant")


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]


@dataclass
class DataStats:
    rows: int = 0
    truncated: int = 0
    dropped_long: int = 0
    dropped_no_labels: int = 0

    def summary(self) -> str:
        return (f"{self.rows} rows; {self.truncated} truncated, {self.dropped_long} dropped as too long, "
                f"{self.dropped_no_labels} dropped with no trainable tokens")


@dataclass
class PreparedData:
    train: list[Sample]
    eval: list[Sample]
    format: str
    stats: DataStats
    fingerprint: str
    eval_stats: DataStats = field(default_factory=DataStats)


# --- loading -----------------------------------------------------------------------------------
def _check_json_file(path: Path, option: str) -> None:
    """Parse JSON / JSON-lines ourselves first, so a broken line is reported with its number."""
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    if path.suffix == ".json" and stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{option}: {path} is not valid JSON at line {e.lineno}: {e.msg}; fix that line") from None
        if not all(isinstance(r, dict) for r in rows):
            raise UserError(f"{option}: {path} must be a list of objects (one per sample)")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{option}: {path} line {number} is not valid JSON ({e.msg}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise UserError(f"{option}: {path} line {number} is not a JSON object; each line must be one sample like {{\"text\": ...}}")


def load_records(source: str, option: str = "--data"):
    """A `datasets.Dataset` from a local file or folder, or a hub dataset name."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = LOCAL_SUFFIXES.get(path.suffix.lower())
            if builder is None:
                raise UserError(f"{option}: {source} has an unsupported extension; use .jsonl, .json, .parquet or .csv")
            if builder == "json":
                _check_json_file(path, option)
                if not path.read_text(encoding="utf-8", errors="replace").strip():
                    raise UserError(f"{option}: {source} is empty; it needs at least one sample")
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if path.is_dir():
            files = [p for p in sorted(path.iterdir()) if p.suffix.lower() in LOCAL_SUFFIXES]
            if not files:
                raise UserError(f"{option}: folder {source} holds no .jsonl/.json/.parquet/.csv files")
            builders = {LOCAL_SUFFIXES[p.suffix.lower()] for p in files}
            if len(builders) > 1:
                raise UserError(f"{option}: folder {source} mixes file types; keep one kind per folder")
            for p in files:
                if LOCAL_SUFFIXES[p.suffix.lower()] == "json":
                    _check_json_file(p, option)
            return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train")
        if source.startswith((".", "/", "~")) or path.suffix.lower() in LOCAL_SUFFIXES:
            raise UserError(f"{option}: {source} does not exist; give a local file or folder, or a hub dataset name")
        return datasets.load_dataset(source, split="train")
    except UserError:
        raise
    except PermissionError:
        raise UserError(f"{option}: {source} is not readable (permission denied)") from None
    except Exception as e:  # datasets raises many types for a bad file or an unreachable hub
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{option}: could not load {source}: {first}") from None


def detect_format(columns, source: str, option: str = "--data") -> str:
    cols = set(columns)
    for name, required in FORMATS.items():
        if set(required) <= cols:
            return name
    raise UserError(f"{option}: {source} has columns {sorted(cols)}, none of the accepted formats: {ACCEPTED}")


# --- tokenization ------------------------------------------------------------------------------
class Tokenization:
    """Turns one record into (input_ids, labels) for a given tokenizer and data format."""

    def __init__(self, tokenizer, fmt: str, train_on_prompt: bool):
        self.tok = tokenizer
        self.fmt = fmt
        self.train_on_prompt = train_on_prompt
        self.eos = tokenizer.eos_token_id
        self.chat_template = tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE

    def _ids(self, text: str, first: bool) -> list[int]:
        # Only the first piece gets the tokenizer's own special tokens (BOS), once.
        return self.tok(text, add_special_tokens=first)["input_ids"]

    def _pieces(self, record: dict, row: int) -> list[tuple[str, bool]]:
        """(text, trainable) pieces in order; for chat, the template renders the text."""
        if self.fmt == "text":
            return [(_text(record, "text", row), True)]
        if self.fmt == "alpaca":
            inp = record.get("input") or ""
            template = ALPACA_WITH_INPUT if str(inp).strip() else ALPACA_NO_INPUT
            prompt = template.format(instruction=_text(record, "instruction", row), input=inp)
            return [(prompt, False), (_text(record, "output", row), True)]
        if self.fmt == "prompt_completion":
            return [(_text(record, "prompt", row), False), (_text(record, "completion", row), True)]
        return self._chat_pieces(_messages(record, row), row)

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=generation_prompt)

    def _chat_pieces(self, messages: list[dict], row: int) -> list[tuple[str, bool]]:
        pieces, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], generation_prompt=True)
            full = self._render(messages[: i + 1], generation_prompt=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise UserError(f"--data: the chat template does not render conversations prefix by prefix (row {row}); loss masks can't be built from it")
            pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        return pieces

    def __call__(self, record: dict, row: int) -> Sample:
        ids: list[int] = []
        labels: list[int] = []
        last_response: list[int] = []
        for text, trainable in self._pieces(record, row):
            if not text:
                continue
            piece = self._ids(text, first=not ids and self.fmt != "messages")
            ids += piece
            labels += piece if (trainable or self.train_on_prompt) else [IGNORE] * len(piece)
            last_response = piece if trainable else last_response
        # Chat templates usually end each assistant turn with EOS themselves; otherwise append it.
        # Either way EOS carries a real label: this is how the model learns to stop.
        if self.eos not in last_response:
            ids.append(self.eos)
            labels.append(self.eos)
        # Nothing predicts a sample's first token: packed behind another sample, it would be
        # trained as that sample's continuation.
        labels[0] = IGNORE
        return Sample(ids, labels)


def _text(record: dict, key: str, row: int) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise UserError(f"--data: row {row}: '{key}' must be a string (got {type(value).__name__})")
    return value


def _messages(record: dict, row: int) -> list[dict]:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"--data: row {row}: 'messages' must be a non-empty list of {{role, content}}")
    clean = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"--data: row {row}: messages[{j}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise UserError(f"--data: row {row}: messages[{j}] has role {m['role']!r}; roles must be system, user or assistant")
        if not isinstance(m["content"], str):
            raise UserError(f"--data: row {row}: messages[{j}].content must be a string")
        clean.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in clean):
        raise UserError(f"--data: row {row}: the conversation has no assistant message, so nothing to train on")
    return clean


def tokenize_all(records, tokenizer, fmt: str, cfg) -> tuple[list[Sample], DataStats]:
    tokenization = Tokenization(tokenizer, fmt, cfg.train_on_prompt)
    stats = DataStats(rows=len(records))
    samples = []
    for row, record in enumerate(records, start=1):
        sample = tokenization(record, row)
        if len(sample.input_ids) > cfg.max_seq_len:
            if cfg.long_samples == "drop":
                stats.dropped_long += 1
                continue
            stats.truncated += 1
            sample = Sample(sample.input_ids[: cfg.max_seq_len], sample.labels[: cfg.max_seq_len])
        # A sample whose labels are all masked adds nothing but a 0/0 to the loss (trl #6668).
        if all(label == IGNORE for label in sample.labels[1:]):
            stats.dropped_no_labels += 1
            continue
        samples.append(sample)
    return samples, stats


def fingerprint(samples: list[Sample]) -> str:
    """Content hash of what is trained on (token ids and masks, in order): changes if the data,
    the tokenizer, the template or the masking changes."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.input_ids, s.labels]).encode())
    return h.hexdigest()[:16]


def prepare_data(cfg, tokenizer) -> PreparedData:
    records = load_records(cfg.data)
    if len(records) == 0:
        raise UserError(f"--data: {cfg.data} is empty; it needs at least one sample")
    fmt = detect_format(records.column_names, cfg.data)
    samples, stats = tokenize_all(records, tokenizer, fmt, cfg)
    eval_samples, eval_stats = [], DataStats()
    if cfg.eval_data:
        eval_records = load_records(cfg.eval_data, "--eval-data")
        if len(eval_records) == 0:
            raise UserError(f"--eval-data: {cfg.eval_data} is empty")
        eval_samples, eval_stats = tokenize_all(eval_records, tokenizer, detect_format(eval_records.column_names, cfg.eval_data, "--eval-data"), cfg)
    elif cfg.eval_split > 0 and samples:
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        n_eval = max(1, math.ceil(len(samples) * cfg.eval_split))
        eval_samples = [samples[i] for i in sorted(order[:n_eval])]
        samples = [samples[i] for i in sorted(order[n_eval:])]
    if not samples:
        raise UserError(f"--data: no usable samples in {cfg.data} ({stats.summary()}); raise --max-seq-len or use --long-samples truncate")
    return PreparedData(samples, eval_samples, fmt, stats, fingerprint(samples), eval_stats)
