"""Prompts for sample generations at evaluation (`--eval-prompts FILE`): a .txt file with one prompt
per line (used as written), or a .jsonl file whose rows hold `prompt` (as written), `instruction`
(+ `input`; the Stanford prompt, as alpaca data is trained) or `messages` (the chat template with its
generation prompt, as chat data is trained)."""

from __future__ import annotations

import json
from pathlib import Path

from lora_tune.data.chat import ChatRenderer
from lora_tune.data.formats import alpaca
from lora_tune.data.formats.messages import normalise
from lora_tune.errors import UserError

MAX_PROMPTS = 8


def read_eval_prompts(path: str, tokenizer, system_message: str = "auto") -> list[list[int]]:
    """The prompts, tokenized (chat-rendered ones carry their own BOS)."""
    texts = _texts(path, tokenizer, system_message)
    bos = tokenizer.bos_token or ""
    return [tokenizer(t, add_special_tokens=not (bos and t.startswith(bos)))["input_ids"] for t in texts]


def _texts(path: str, tokenizer, system_message: str) -> list[str]:
    file = Path(path).expanduser()
    if file.is_dir():
        raise UserError(f"--eval-prompts: {path} is a folder; give a .txt file (one prompt per line) or a .jsonl file")
    if not file.is_file():
        raise UserError(f"--eval-prompts: {path} does not exist; give a .txt file (one prompt per line) or a .jsonl file")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--eval-prompts: {path} is not UTF-8 text; give a .txt file (one prompt per line) or a .jsonl file") from None
    except OSError as e:
        raise UserError(f"--eval-prompts: {path} is unreadable ({e.strerror or e})") from None
    if "\x00" in text:
        raise UserError(f"--eval-prompts: {path} holds binary data (NUL bytes); give a .txt file (one prompt per line) or a .jsonl file")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"--eval-prompts: {path} holds no prompts")
    if len(lines) > MAX_PROMPTS:
        raise UserError(
            f"--eval-prompts: {path} holds {len(lines)} prompts; give at most {MAX_PROMPTS} (each is generated at every evaluation)"
        )
    if file.suffix.lower() != ".jsonl":
        return [line.replace("\\n", "\n") for line in lines]
    prompts, chat = [], None
    for n, line in enumerate(lines, start=1):
        where = f"--eval-prompts {path}: line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{where} is not valid JSON") from None
        if not isinstance(row, dict):
            raise UserError(
                f"{where} is a JSON {type(row).__name__}; each line must be an object with a 'prompt', 'instruction' or 'messages' field"
            )
        if isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row.get("instruction"), str):
            extra = row.get("input") or ""
            if not isinstance(extra, str):
                raise UserError(f"{where}: 'input' must be a string (got {type(extra).__name__})")
            prompts.append((alpaca.WITH_INPUT if extra.strip() else alpaca.NO_INPUT).format(instruction=row["instruction"], input=extra))
        elif "messages" in row:
            if not isinstance(row["messages"], list):
                raise UserError(f"{where}: 'messages' must be a list of {{role, content}} (got {type(row['messages']).__name__})")
            chat = chat or ChatRenderer(tokenizer, system_message)
            messages = normalise(row["messages"] + [{"role": "assistant", "content": "x"}], where)[:-1]
            prompts.append(chat.generation_prompt(messages, where))
        else:
            raise UserError(f"{where} needs a 'prompt', 'instruction' or 'messages' field")
    return prompts
