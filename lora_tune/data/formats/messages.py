"""Chat in the OpenAI shape: `messages`, a list of {role, content}; roles system (or developer),
user, assistant and tool; an assistant turn may carry `tool_calls`; content may be a list of text
parts. An optional `tools` column (the tool schemas) goes to the template. The loss is on the
assistant turns, tool calls included.

Image-text data: typed image parts (`{"type": "image", "image": "img/1.png"}`, also `path` / `url`
keys, or OpenAI's `image_url`), or `<image>` placeholders in the text with an `images` column (one
file per placeholder, LLaMA-Factory's style). Files are relative to the data file's folder."""

from __future__ import annotations

from lora_tune.errors import UserError

NAME = "messages"
COLUMNS = ("messages",)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def claims(columns: set) -> bool:
    return True


PLACEHOLDER = "<image>"  # LLaMA-Factory / ShareGPT style: one per entry of an `images` column
IMAGE_KEYS = ("image", "path", "url")  # where a typed image part names its file (TRL, axolotl, Unsloth)


def _image_ref(part: dict):
    if part.get("type") == "image_url":  # OpenAI's {"type": "image_url", "image_url": {"url": ...}}
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return next((part[k] for k in IMAGE_KEYS if part.get(k) is not None), None)


def content_of(content, where: str, refs: list | None = None):
    """A string, or the text parts of a list of parts joined (OpenAI's content parts). With `refs`
    (image-text data), image parts are kept as {"type": "image"} for the chat template to render, and
    their files appended to `refs` in order; without it, they are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UserError(f"{where}: content must be a string or a list of text parts (got {type(content).__name__})")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image", "image_url") and refs is not None:
            refs.append(_image_ref(part))  # None: the file comes from an `images` column (TRL's style)
            parts.append({"type": "image"})
        elif kind in ("image", "image_url"):
            raise UserError(f"{where}: an image part; images train in sft chat data (messages or conversations) only, for now")
        else:
            raise UserError(f"{where}: a content part of type {kind!r}; only text and image parts can be trained here")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _placeholders_to_parts(text: str) -> list[dict] | str:
    if PLACEHOLDER not in text:
        return text
    parts = []
    for k, chunk in enumerate(text.split(PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return parts


def normalise(messages, where: str, key: str = "messages", refs: list | None = None, images=None) -> list[dict]:
    """The conversation with canonical roles. `refs` (a list to fill): image-text data, image parts
    kept; `images`: an `images` column, one file per `<image>` placeholder in the text, in order."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: '{key}' must be a non-empty list of {{role, content}}")
    clean = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise UserError(f"{where}: {key}[{j}] must be an object with 'role' and 'content'")
        role = ROLES.get(m["role"])
        if role is None:
            raise UserError(f"{where}: {key}[{j}] has role {m['role']!r}; roles must be system, user, assistant or tool")
        message = {"role": role, "content": content_of(m.get("content"), f"{where}: {key}[{j}]", refs)}
        if m.get("tool_calls"):
            message["tool_calls"] = m["tool_calls"]
        for extra in ("name", "tool_call_id"):
            if m.get(extra) is not None:
                message[extra] = m[extra]
        clean.append(message)
    if not any(m["role"] == "assistant" for m in clean):
        raise UserError(f"{where}: the conversation has no assistant message, so nothing to train on")
    if images is not None:
        _column_images(clean, images, where, refs)
    elif refs is not None and None in refs:
        raise UserError(f"{where}: an image part without a file: give it as {{'type': 'image', 'image': 'path/to.png'}}")
    return clean


def _column_images(messages: list[dict], images, where: str, refs: list | None) -> None:
    """An `images` column: each `<image>` placeholder in the text becomes an image part."""
    if refs is None:
        raise UserError(f"{where}: an 'images' column; images train in sft chat data (messages or conversations) only, for now")
    if not isinstance(images, list):
        images = [images]
    if refs and any(r is not None for r in refs):
        raise UserError(f"{where}: images both as message parts and in an 'images' column; give them one way")
    if refs:  # image parts without files, the files in the column in order (TRL's style)
        if len(refs) != len(images):
            raise UserError(f"{where}: {len(refs)} image part(s) but {len(images)} image(s) in 'images'; give one image per part")
        refs[:] = images
        return
    placeholders = sum(m["content"].count(PLACEHOLDER) for m in messages if isinstance(m["content"], str))
    if placeholders != len(images):
        raise UserError(
            f"{where}: {placeholders} {PLACEHOLDER} placeholder(s) in the text but {len(images)} image(s) in 'images'; "
            f"put one {PLACEHOLDER} where each image goes"
        )
    for m in messages:
        if isinstance(m["content"], str):
            m["content"] = _placeholders_to_parts(m["content"])
    refs.extend(images)


def image_refs(record: dict, where: str, key: str = "messages") -> list:
    """The record's image files, in the order the conversation shows them."""
    refs: list = []
    normalise(record.get(key), where, key, refs, record.get("images"))
    return refs


def images(record: dict, where: str) -> list:
    return image_refs(record, where)


def pieces(record: dict, where: str, chat) -> list[tuple[str, bool]]:
    messages = normalise(record.get("messages"), where, refs=[], images=record.get("images"))
    return chat.pieces(messages, where, tools=record.get("tools") or None)
