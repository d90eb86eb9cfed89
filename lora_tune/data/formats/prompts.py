"""Prompts to complete (online RL, `--objective grpo`): `prompt`, a string used as written, or a
list of chat turns rendered with the model's template up to where the assistant's answer starts
(TRL's conversational prompts). Nothing is trained on the prompt; the policy's completions are.
Every other column travels with the prompt to the reward functions, as TRL passes them
(`answer=[...]`), and the prompt itself reaches them as the user wrote it (text, or messages). A
`tools` column of tool schemas goes to the template; one of tool names picks among the run's --tools
(the rollout renders those prompts, lora_tune.training.episodes)."""

from __future__ import annotations

from lora_tune.data.formats.messages import normalise
from lora_tune.errors import UserError

NAME = "prompts"
KIND = "prompts"
COLUMNS = ("prompt",)


def claims(columns: set) -> bool:
    return True


def prompt_text(record: dict, where: str, chat) -> tuple[str, bool]:
    """(the prompt's text, whether the chat template rendered it: then it writes BOS itself)."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise UserError(f"{where}: 'prompt' is empty; every row needs a prompt to complete")
        return prompt, False
    if not isinstance(prompt, list) or not prompt:
        raise UserError(f"{where}: 'prompt' must be a string or a non-empty list of {{role, content}} (got {type(prompt).__name__})")
    # normalise wants an assistant turn to train on; a prompt ends before the answer.
    turns = normalise(prompt + [{"role": "assistant", "content": "x"}], where, "prompt")[:-1]
    if turns[-1]["role"] == "assistant":
        raise UserError(f"{where}: the prompt's last turn is the assistant's; a prompt ends where the answer starts")
    tools = record.get("tools") or None
    if isinstance(tools, list) and all(isinstance(t, str) for t in tools):
        tools = None  # names of the run's --tools: the rollout renders each episode with their schemas
    return chat.generation_prompt(turns, where, tools), True
