"""Chat in the OpenAI shape: `messages`, a list of {role, content}; roles system (or developer),
user, assistant and tool; an assistant turn may carry `tool_calls`; content may be a list of text
parts. An optional `tools` column (the tool schemas) goes to the template. The loss is on the
assistant turns, tool calls included."""

from __future__ import annotations

from lora_tune.errors import UserError

NAME = "messages"
COLUMNS = ("messages",)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def claims(columns: set) -> bool:
    return True


def text_of(content, where: str) -> str:
    """A string, or the text parts of a list of parts joined (OpenAI's content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UserError(f"{where}: a content part of type {kind!r}; only text parts can be trained here")
        return "".join(texts)
    raise UserError(f"{where}: content must be a string or a list of text parts (got {type(content).__name__})")


def normalise(messages, where: str, key: str = "messages") -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: '{key}' must be a non-empty list of {{role, content}}")
    clean = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise UserError(f"{where}: {key}[{j}] must be an object with 'role' and 'content'")
        role = ROLES.get(m["role"])
        if role is None:
            raise UserError(f"{where}: {key}[{j}] has role {m['role']!r}; roles must be system, user, assistant or tool")
        message = {"role": role, "content": text_of(m.get("content"), f"{where}: {key}[{j}]")}
        if m.get("tool_calls"):
            message["tool_calls"] = m["tool_calls"]
        for extra in ("name", "tool_call_id"):
            if m.get(extra) is not None:
                message[extra] = m[extra]
        clean.append(message)
    if not any(m["role"] == "assistant" for m in clean):
        raise UserError(f"{where}: the conversation has no assistant message, so nothing to train on")
    return clean


def pieces(record: dict, where: str, chat) -> list[tuple[str, bool]]:
    return chat.pieces(normalise(record.get("messages"), where), where, tools=record.get("tools") or None)
