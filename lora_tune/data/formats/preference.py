"""Preference pairs: `prompt` + `chosen` + `rejected` (TRL's and UltraFeedback's shapes). Strings are
plain text: the prompt, then the completion (EOS appended). Message lists are conversations rendered
with the chat template: `prompt` a list of turns (or a string: one user turn) and `chosen`/`rejected`
the assistant turn(s) that follow (or a string: one assistant turn); without a `prompt` column,
`chosen` and `rejected` are whole conversations whose shared first turns are the prompt. Each pair
is two sequences, the same prompt with each completion; the loss is on the completions only."""

from __future__ import annotations

from lora_tune.data.formats.fields import string
from lora_tune.data.formats.messages import normalise
from lora_tune.errors import UserError

NAME = "preference"
KIND = "pairs"
COLUMNS = ("chosen", "rejected")


def claims(columns: set) -> bool:
    return True


def _turns(value, where: str, key: str, role: str) -> list[dict]:
    """A side as message dicts: a string becomes one turn of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: '{key}' must be a string or a non-empty list of {{role, content}}")
    return normalise(value + ([{"role": "assistant", "content": "x"}] if role == "user" else []), where, key)[: len(value)]


def split_conversations(chosen: list[dict], rejected: list[dict], where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen completion, rejected completion) of two whole conversations: the prompt is
    the turns they share, and it must stop before an assistant turn."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    while shared and chosen[shared - 1]["role"] == "assistant":
        shared -= 1  # an identical first answer belongs to the completions, not the prompt
    if not shared or shared == len(chosen) or shared == len(rejected):
        raise UserError(f"{where}: 'chosen' and 'rejected' share no prompt turns, or one of them has no answer after the prompt")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def sequences(record: dict, where: str, chat) -> list[tuple[list[tuple[str, bool]], bool]]:
    """The two sequences of a pair, each as (text, trainable) pieces and whether the chat template
    rendered it (then it writes BOS itself)."""
    for key in COLUMNS:
        if record.get(key) in (None, "", []):
            raise UserError(f"{where}: '{key}' is missing or empty; every pair needs a prompt, a chosen and a rejected answer")
    prompt = record.get("prompt")
    conversational = not isinstance(record["chosen"], str) or not (prompt is None or isinstance(prompt, str))
    if not conversational:
        if prompt is None:
            raise UserError(f"{where}: plain-text pairs need a 'prompt' column beside 'chosen' and 'rejected'")
        text = string(record, "prompt", where)
        return [([(text, False), (string(record, side, where), True)], False) for side in COLUMNS]
    if prompt is None:
        prompt_turns, chosen, rejected = split_conversations(
            _turns(record["chosen"], where, "chosen", "assistant"), _turns(record["rejected"], where, "rejected", "assistant"), where
        )
    else:
        prompt_turns = _turns(prompt, where, "prompt", "user")
        chosen, rejected = (_turns(record[side], where, side, "assistant") for side in COLUMNS)
    tools = record.get("tools") or None
    return [(chat.completion_pieces(prompt_turns, completion, where, tools), True) for completion in (chosen, rejected)]
