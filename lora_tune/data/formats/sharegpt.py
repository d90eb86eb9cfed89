"""ShareGPT: `conversations`, a list of {from, value}; from is human/user, gpt/assistant/model,
system, or tool/function/observation (a tool's result); a `function_call` turn is the assistant
calling a tool (its value the JSON call). Optional `system` and `tools` columns, as LLaMA-Factory
writes them, and `images` (one file per `<image>` placeholder in the turns). Turns given as {role,
content} are read too. The loss is on the assistant turns."""

from __future__ import annotations

import json

from lora_tune.data.formats.messages import normalise
from lora_tune.errors import UserError

NAME = "sharegpt"
COLUMNS = ("conversations",)
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_call": "function_call",
}


def claims(columns: set) -> bool:
    return True


def to_messages(turns, where: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}")
    messages = []
    for j, turn in enumerate(turns):
        if isinstance(turn, dict) and "from" in turn:
            speaker, value = turn["from"], turn.get("value")
        elif isinstance(turn, dict) and "role" in turn:
            speaker, value = turn["role"], turn.get("content")
        else:
            raise UserError(f"{where}: conversations[{j}] must be an object with 'from' and 'value'")
        role = ROLES.get(str(speaker).lower())
        if role is None:
            raise UserError(f"{where}: conversations[{j}] is from {speaker!r}; use human, gpt, system, or tool/function_call")
        if role == "function_call":
            try:
                call = json.loads(value) if isinstance(value, str) else value
                messages.append(
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}],
                    }
                )
            except (ValueError, TypeError, KeyError):
                raise UserError(
                    f'{where}: conversations[{j}] (function_call) must hold a JSON call like {{"name": ..., "arguments": ...}}'
                ) from None
        else:
            messages.append({"role": role, "content": value})
    return messages


def _messages(record: dict, where: str) -> list[dict]:
    messages = to_messages(record.get("conversations"), where)
    if isinstance(record.get("system"), str) and record["system"].strip() and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": record["system"]})
    return messages


def images(record: dict, where: str) -> list:
    refs: list = []
    normalise(_messages(record, where), where, "conversations", refs, record.get("images"))
    return refs


def pieces(record: dict, where: str, chat) -> list[tuple[str, bool]]:
    messages = _messages(record, where)
    tools = record.get("tools")
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except ValueError:
            raise UserError(f"{where}: 'tools' must be JSON (a list of tool schemas)") from None
    messages = normalise(messages, where, "conversations", [], record.get("images"))
    return chat.pieces(messages, where, tools=tools or None)
