"""Eval prompts: a .txt with one prompt per line, or .jsonl rows rendered as the training data is."""

from __future__ import annotations

import json

import pytest

from lora_tune.data.formats.alpaca import NO_INPUT
from lora_tune.data.prompts import read_eval_prompts
from lora_tune.errors import UserError


def test_text_lines_are_prompts_as_written(tmp_path, tokenizer):
    path = tmp_path / "p.txt"
    path.write_text("Hello there\n\nTwo\\nlines\n")
    prompts = read_eval_prompts(str(path), tokenizer)
    assert [tokenizer.decode(p.ids, skip_special_tokens=True) for p in prompts] == ["Hello there", "Two\nlines"]
    assert all(p.images == () and p.pixel_inputs is None for p in prompts)


def test_jsonl_rows_are_rendered_like_their_training_format(tmp_path, tokenizer):
    rows = [{"prompt": "Say hi"}, {"instruction": "Add 1 and 2."}, {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = [tokenizer.decode(p.ids) for p in read_eval_prompts(str(path), tokenizer)]
    assert prompts[1].endswith(NO_INPUT.format(instruction="Add 1 and 2.", input="")) and prompts[1].count("<s>") == 1
    assert prompts[2] == tokenizer.apply_chat_template(rows[2]["messages"], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "holds no prompts"),
        ("\n".join(f"p{i}" for i in range(9)), "holds 9 prompts; give at most 8"),
        ('{"prompt": 1}\n', "line 1 needs a 'prompt', 'instruction' or 'messages' field"),
        ("not json\n", "line 1 is not valid JSON"),
        ('{"prompt": "ok"}\n[1, 2]\n', "line 2 is a JSON list; each line must be an object"),
        ('"a json string"\n', "line 1 is a JSON str"),
        ('{"instruction": "Add.", "input": 3}\n', "line 1: 'input' must be a string"),
        ('{"messages": "hi"}\n', "line 1: 'messages' must be a list of"),
        ('{"messages": [{"role": "user", "content": 5}]}\n', "content must be a string or a list of text parts"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]}\n',
            "line 1 shows images, but --base is a text-only model; drop its images",
        ),
    ],
)
def test_a_bad_prompt_file_is_one_error_naming_the_line(tmp_path, tokenizer, content, message):
    path = tmp_path / ("p.jsonl" if "{" in content or "json" in content else "p.txt")
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        read_eval_prompts(str(path), tokenizer)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
@pytest.mark.parametrize("data,message", [(b"\xff\xfe\x00\x01 binary", "is not UTF-8 text"), (b"ok\x00\x00\n", "holds binary data")])
def test_a_binary_prompt_file_is_one_error(suffix, data, message, tmp_path, tokenizer):
    path = tmp_path / f"p{suffix}"
    path.write_bytes(data)
    with pytest.raises(UserError, match=f"--eval-prompts: .* {message}"):
        read_eval_prompts(str(path), tokenizer)
