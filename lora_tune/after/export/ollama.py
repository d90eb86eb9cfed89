"""`--format ollama`: a folder with model.gguf and a Modelfile that `ollama create NAME -f Modelfile` takes.

Ollama renders prompts with Go templates, not Jinja, so the model's chat template is translated:
it is rendered (through transformers) on marker conversations to find what each role's turn looks
like - the text before and after a message's content - and the generation prompt; a Go template is
written from those pieces (`.Messages`, `.Role`, `.Content`, as Ollama's own templates use them), and
checked by predicting the Jinja rendering of a longer conversation from the same pieces. A template
that is not "the same wrapper around every turn of a role" (it numbers turns, branches on content,
...) can't be translated faithfully: refused in one line, with --format gguf as the way out (its
chat template is embedded; write your own TEMPLATE).

Stop tokens: the EOS token and every token the template closes a turn with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from lora_tune.errors import UserError

MARK = "\x1f{}\x1f"  # a marker no template produces by itself
DEFAULT_PARAMETERS = {"temperature": 0.7, "top_p": 0.9, "num_ctx": 4096}


@dataclass
class TurnPieces:
    """What the chat template writes around messages."""

    start: str  # before the first message (e.g. BOS)
    wrap: dict[str, tuple[str, str]]  # role -> (before content, after content)
    generation: str  # the assistant prefix add_generation_prompt appends
    system_in_user: bool  # the template has no system role: system text goes into the first user turn


def render(tokenizer, messages, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _split(text: str, *markers: str) -> list[str]:
    """text around the markers, in order: [before m1, between m1 and m2, ..., after the last]."""
    parts, rest = [], text
    for marker in markers:
        before, sep, rest = rest.partition(marker)
        if not sep:
            raise UserError(
                "--format ollama: the chat template drops or rewrites a message's text, so it can't be written as an Ollama TEMPLATE; "
                "use --format gguf (the chat template is embedded) and write your own TEMPLATE"
            )
        parts.append(before)
    return parts + [rest]


def _strip(text: str, prefix: str = "", suffix: str = "") -> str:
    if not (text.startswith(prefix) and text.endswith(suffix)) or len(text) < len(prefix) + len(suffix):
        raise UserError(
            "--format ollama: the chat template writes a role's turn differently depending on what precedes it, so it can't be written "
            "as an Ollama TEMPLATE; use --format gguf (the chat template is embedded) and write your own TEMPLATE"
        )
    return text[len(prefix) : len(text) - len(suffix)]


def turn_pieces(tokenizer) -> TurnPieces:
    """Render marker conversations and cut them into per-role wrappers:
    [u] gives start+user prefix | user suffix; [u, a] the assistant prefix and suffix; [u, a, u]
    separates the user prefix from the start; [s, u, a] the system wrapper (or shows there is no
    system role: the template raises)."""
    s, u1, a2, u3 = (MARK.format(x) for x in ("s", "u1", "a2", "u3"))
    user, assistant, system = (
        (lambda c: {"role": "user", "content": c}),
        (lambda c: {"role": "assistant", "content": c}),
        (lambda c: {"role": "system", "content": c}),
    )
    head, user_suffix = _split(render(tokenizer, [user(u1)], False), u1)
    with_generation = render(tokenizer, [user(u1)], True)
    generation = _strip(with_generation, head + u1 + user_suffix)
    _, user_then_assistant, assistant_suffix = _split(render(tokenizer, [user(u1), assistant(a2)], False), u1, a2)
    assistant_prefix = _strip(user_then_assistant, user_suffix)
    _, _, assistant_then_user, _ = _split(render(tokenizer, [user(u1), assistant(a2), user(u3)], False), u1, a2, u3)
    user_prefix = _strip(assistant_then_user, assistant_suffix)
    start = _strip(head, "", user_prefix)
    wrap = {"user": (user_prefix, user_suffix), "assistant": (assistant_prefix, assistant_suffix)}
    try:
        with_system = render(tokenizer, [system(s), user(u1), assistant(a2)], False)
    except Exception:  # noqa: BLE001 - templates refuse a system role by raising (jinja2 TemplateError and kin)
        return TurnPieces(start, wrap, generation, system_in_user=True)
    before_system, system_then_user, _, _ = _split(with_system, s, u1, a2)
    wrap["system"] = (_strip(before_system, start), _strip(system_then_user, "", user_prefix))
    return TurnPieces(start, wrap, generation, system_in_user=False)


def predict(pieces: TurnPieces, messages: list[dict], generation: bool) -> str:
    """What the Go template below renders for these messages (the same pieces, in Python)."""
    out = pieces.start
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"] if pieces.system_in_user else messages
    for i, m in enumerate(rest):
        before, after = pieces.wrap[m["role"]]
        content = m["content"]
        if pieces.system_in_user and m["role"] == "user" and i == 0 and system:
            content = "\n\n".join(system) + "\n\n" + content  # as training merged it (--system-message merge)
        out += before + content + after
    return out + (pieces.generation if generation else "")


def go_template(pieces: TurnPieces, bos: str | None, add_bos: bool) -> str:
    """An Ollama TEMPLATE from the pieces. llama.cpp adds BOS itself when the vocabulary says so,
    so a BOS the Jinja template writes is left out here (else it would be there twice)."""

    def q(text: str) -> str:
        return text.replace("{{", '{{ "{{" }}')  # literal braces survive Go's parser

    start = pieces.start
    if add_bos and bos and start.startswith(bos):
        start = start[len(bos) :]
    # One line, no whitespace-trimming actions ({{- ... }}): the turn wrappers' own newlines are
    # part of the prompt and a trim marker would eat them.
    parts = [q(start), "{{ range $i, $m := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"]
    if "system" in pieces.wrap:
        before, after = pieces.wrap["system"]
        parts.append(f'{{{{ if eq .Role "system" }}}}{q(before)}{{{{ .Content }}}}{q(after)}')
        user_content = "{{ .Content }}"
    else:
        # no system role in the template: the system text opens the first user turn, as training did
        parts.append('{{ if eq .Role "system" }}')
        user_content = "{{ if and $.System (eq $i 1) }}{{ $.System }}\n\n{{ end }}{{ .Content }}"
    before, after = pieces.wrap["user"]
    parts.append(
        f'{{{{ else if eq .Role "user" }}}}{q(before)}{user_content}{q(after)}{{{{ if $last }}}}{q(pieces.generation)}{{{{ end }}}}'
    )
    before, after = pieces.wrap["assistant"]
    parts.append(f'{{{{ else if eq .Role "assistant" }}}}{q(before)}{{{{ .Content }}}}{{{{ if not $last }}}}{q(after)}{{{{ end }}}}')
    parts.append("{{ end }}{{ end }}")
    return "".join(parts)


def stop_tokens(tokenizer, pieces: TurnPieces) -> list[str]:
    """EOS, and every special token that closes a turn in the template (e.g. <|im_end|>)."""
    specials = set(tokenizer.all_special_tokens)
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    for _, after in pieces.wrap.values():
        stops += [tok for tok in specials if tok and tok in after and tok not in stops]
    return stops


def write_modelfile(folder: Path, tokenizer_dir: Path, config: dict, gguf_name: str) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not tokenizer.chat_template:
        raise UserError(
            f"--format ollama: the tokenizer in {tokenizer_dir} has no chat template, so Ollama would not know how to prompt it; "
            "use --format gguf and write your own TEMPLATE"
        )
    pieces = turn_pieces(tokenizer)
    check_pieces(tokenizer, pieces)
    add_bos = bool(tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]) if tokenizer.bos_token_id is not None else False
    lines = [
        "# Written by `lora-tune export --format ollama`; create the model with: ollama create NAME -f Modelfile",
        f"FROM ./{gguf_name}",
        "",
        f'TEMPLATE """{go_template(pieces, tokenizer.bos_token, add_bos)}"""',
        "",
    ]
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stop_tokens(tokenizer, pieces)]
    lines += [f"PARAMETER {k} {v}" for k, v in DEFAULT_PARAMETERS.items()]
    path = folder / "Modelfile"
    path.write_text("\n".join(lines) + "\n")
    (folder / "template_pieces.json").write_text(
        json.dumps(
            {"start": pieces.start, "wrap": pieces.wrap, "generation": pieces.generation, "system_in_user": pieces.system_in_user}, indent=2
        )
    )
    return path


CHECK_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "It is 6."},
    {"role": "user", "content": "Thanks!"},
]


def check_pieces(tokenizer, pieces: TurnPieces) -> None:
    """The pieces must predict the Jinja rendering of a longer conversation exactly."""
    conversation = CHECK_CONVERSATION
    if pieces.system_in_user:
        merged = [dict(m) for m in conversation[1:]]
        merged[0]["content"] = conversation[0]["content"] + "\n\n" + merged[0]["content"]
        want = render(tokenizer, merged, True)
    else:
        want = render(tokenizer, conversation, True)
    got = predict(pieces, conversation, True)
    if got != want:
        raise UserError(
            "--format ollama: the chat template is not the same wrapper around every turn of a role, so it can't be written as an Ollama "
            "TEMPLATE faithfully; use --format gguf (the chat template is embedded) and write your own TEMPLATE"
        )


def check_modelfile(path: Path, tokenizer_dir: Path) -> None:
    """The written Modelfile names the GGUF beside it and holds a TEMPLATE and stop parameters."""
    text = path.read_text()
    gguf = path.parent / text.split("FROM ./", 1)[1].split("\n", 1)[0]
    if not gguf.is_file() or 'TEMPLATE """' not in text or "PARAMETER stop" not in text:
        raise UserError(f"verification failed: {path} is incomplete", exit_code=1)
