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
    if not file.is_file():
        raise UserError(f"--eval-prompts: {path} does not exist; give a .txt file (one prompt per line) or a .jsonl file")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
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
        if isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row.get("instruction"), str):
            extra = row.get("input") or ""
            prompts.append((alpaca.WITH_INPUT if extra.strip() else alpaca.NO_INPUT).format(instruction=row["instruction"], input=extra))
        elif "messages" in row:
            chat = chat or ChatRenderer(tokenizer, system_message)
            messages = normalise(row["messages"] + [{"role": "assistant", "content": "x"}], where)[:-1]
            prompts.append(chat.generation_prompt(messages, where))
        else:
            raise UserError(f"{where} needs a 'prompt', 'instruction' or 'messages' field")
    return prompts
