"""Conversations through the model's own chat template, cut into prompt and response pieces.

The template renders the conversation prefix by prefix (up to each assistant turn with the
generation prompt, then including it); the difference between two renderings is one piece, so the
loss covers exactly the assistant turns (tool calls included) and nothing is found again by
matching tokens. Templates that refuse a system message or demand strict alternation (Mistral,
Gemma) raise while rendering: that becomes one error line naming the row and the rule. A system
message is kept, merged into the first user turn, or dropped (`--system-message`); `auto` keeps
it where the template accepts one and merges it otherwise (what users of Gemma/Mistral do by hand).
"""

from __future__ import annotations

from lora_tune.errors import UserError, first_line

# For models without a chat template (documented in the README).
FALLBACK_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}### Assistant:\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{{ eos_token }}\n\n"
    "{% elif message['role'] == 'user' %}### User:\n{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'tool' %}### Tool result:\n{{ message['content'] }}\n\n"
    "{% else %}### System:\n{{ message['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


class ChatRenderer:
    def __init__(self, tokenizer, system_message: str = "auto"):
        self.tok = tokenizer
        self.template = tokenizer.chat_template or FALLBACK_TEMPLATE
        if isinstance(self.template, dict):  # several named templates: the default one
            self.template = self.template.get("default") or next(iter(self.template.values()))
        self.system_message = system_message
        if system_message == "auto":
            self.system_message = "keep" if self._accepts_system() else "merge"
        self.tool_aware = "tool" in self.template

    def _accepts_system(self) -> bool:
        try:
            self._render(
                [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], False, None
            )
        except Exception:  # noqa: BLE001 - templates refuse with whatever they raise
            return False
        return True

    def _render(self, messages: list[dict], generation_prompt: bool, tools):
        return self.tok.apply_chat_template(
            messages, chat_template=self.template, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _system(self, messages: list[dict]) -> list[dict]:
        system = [m for m in messages if m["role"] == "system"]
        if not system or self.system_message == "keep":
            return messages
        rest = [m for m in messages if m["role"] != "system"]
        if self.system_message == "merge" and rest and rest[0]["role"] == "user":
            text = "\n\n".join(m["content"] for m in system)
            first = rest[0]["content"]  # a string, or image-text parts
            merged = f"{text}\n\n{first}" if isinstance(first, str) else [{"type": "text", "text": f"{text}\n\n"}, *first]
            rest[0] = {**rest[0], "content": merged}
        return rest

    def pieces(self, messages: list[dict], where: str, tools=None) -> list[tuple[str, bool]]:
        messages = self._system(messages)
        if not self.tool_aware and any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            raise UserError(
                f"{where}: the conversation has tool calls or results, but this model's chat template has no tool support; "
                "drop those rows or use a model whose template renders tools"
            )
        pieces, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                prompt = self._render(messages[:i], True, tools)
                full = self._render(messages[: i + 1], False, tools)
            except Exception as e:  # noqa: BLE001 - jinja2's TemplateError and raise_exception()'s messages
                rule = first_line(e)
                fix = (
                    "merge consecutive turns of one role, or pass --system-message merge|drop"
                    if "system" not in rule.lower()
                    else "pass --system-message merge or drop"
                )
                raise UserError(f"{where}: the model's chat template refuses this conversation ({rule}); {fix}") from None
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise UserError(
                    f"{where}: the chat template does not render conversations prefix by prefix; loss masks can't be built from it"
                )
            pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            done = full
        return pieces

    def generation_prompt(self, messages: list[dict], where: str, tools=None) -> str:
        """The conversation so far, rendered up to where the assistant's answer starts."""
        try:
            return self._render(self._system(messages), True, tools)
        except Exception as e:  # noqa: BLE001 - as in pieces()
            raise UserError(f"{where}: the model's chat template refuses this conversation ({first_line(e)})") from None

    def completion_pieces(self, prompt: list[dict], completion: list[dict], where: str, tools=None) -> list[tuple[str, bool]]:
        """A prompt and one completion of it (preference data): the prompt rendered up to where the
        answer starts, untrained, then everything the completion adds, trained (TRL renders the
        same two texts)."""
        messages = self._system(prompt + completion)
        cut = len(messages) - len(completion)
        try:
            head = self._render(messages[:cut], True, tools)
            full = self._render(messages, False, tools)
        except Exception as e:  # noqa: BLE001 - as in pieces()
            raise UserError(f"{where}: the model's chat template refuses this conversation ({first_line(e)})") from None
        if not full.startswith(head):
            raise UserError(f"{where}: the chat template renders the prompt differently with its answer; loss masks can't be built from it")
        return [(head, False), (full[len(head) :], True)]
