"""Prompts for sample generations at evaluation (`--eval-prompts FILE`): a .txt file with one prompt
per line (used as written), or a .jsonl file whose rows hold `prompt` (as written), `instruction`
(+ `input`; the Stanford prompt, as alpaca data is trained) or `messages` (the chat template with its
generation prompt, as chat data is trained). On an image-text base, `messages` may show images as the
training data does (typed image parts, or `<image>` placeholders with an `images` column), paths
relative to the prompts file: each placeholder is expanded to its image's tokens by the base's
processor, and the images go to generation as pixel inputs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_tune.data import images as image_files
from lora_tune.data.chat import ChatRenderer
from lora_tune.data.formats import alpaca
from lora_tune.data.formats.messages import normalise
from lora_tune.errors import UserError

MAX_PROMPTS = 8


@dataclass(frozen=True)
class EvalPrompt:
    """A prompt's token ids (image placeholders expanded); its image files in order, and what the
    model's `generate` takes of them (pixel values, token types)."""

    ids: list[int]
    images: tuple[str, ...] = ()
    pixel_inputs: dict[str, torch.Tensor] | None = None


def read_eval_prompts(path: str, tokenizer, system_message: str = "auto", image_text=None) -> list[EvalPrompt]:
    """The prompts, tokenized (chat-rendered ones carry their own BOS). `image_text`: the base's
    processor (`lora_tune.models.processors.ImageText`), None for a text base, or why it can't load."""
    bos = tokenizer.bos_token or ""
    prompts = []
    for text, files, where in _texts(path, tokenizer, system_message, image_text):
        special = not (bos and text.startswith(bos))
        if not files:
            prompts.append(EvalPrompt(tokenizer(text, add_special_tokens=special)["input_ids"]))
            continue
        written = text.count(image_text.placeholder)
        if written != len(files):
            raise UserError(
                f"{where}: the chat template wrote {written} image placeholder(s) for {len(files)} image(s); use the checkpoint's own "
                "chat template"
            )
        pictures = [image_files.load(f, where, image_text.max_pixels, image_text.min_pixels) for f in files]
        bos_id = tokenizer.bos_token_id
        adds_bos = special and bos_id is not None and tokenizer("a")["input_ids"][:1] == [bos_id]
        ids = [bos_id] * adds_bos + image_text.expand(text, pictures)
        pixels = {**image_text.pixel_inputs(pictures), **image_text.token_type_inputs(torch.tensor([ids]))}
        prompts.append(EvalPrompt(ids, tuple(str(f) for f in files), pixels))
    return prompts


def _texts(path: str, tokenizer, system_message: str, image_text=None) -> list[tuple[str, list[Path], str]]:
    """(text, image files, where) of each prompt."""
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
        return [(line.replace("\\n", "\n"), [], f"--eval-prompts {path}: line {n}") for n, line in enumerate(lines, start=1)]
    prompts, texts, chat = [], [], None
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
        files: list[Path] = []
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
            refs: list = []
            messages = normalise(row["messages"] + [{"role": "assistant", "content": "x"}], where, refs=refs, images=row.get("images"))[:-1]
            if refs and not hasattr(image_text, "expand"):
                why = image_text if isinstance(image_text, str) else "--base is a text-only model"
                raise UserError(f"{where} shows images, but {why}; drop its images")
            files = [image_files.resolve(ref, file.parent, where) for ref in refs]
            prompts.append(chat.generation_prompt(messages, where))
        else:
            raise UserError(f"{where} needs a 'prompt', 'instruction' or 'messages' field")
        texts.append((prompts[-1], files, where))
    return texts
