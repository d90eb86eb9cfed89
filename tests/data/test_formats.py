"""Each format's loss masks, token by token: prompt pieces masked, responses (and EOS) trained."""

from __future__ import annotations

import json

import pytest

from lora_tune.data.formats import detect
from lora_tune.data.formats.alpaca import NO_INPUT as ALPACA_NO_INPUT
from lora_tune.data.prepare import Sample, prepare_data
from lora_tune.data.tokenize import KEPT
from lora_tune.errors import UserError
from lora_tune.models.head import IGNORE
from lora_tune.models.loading import load_tokenizer

from helpers import ALPACA, data_config, tokenize_one, tokenize_rows, trained_spans, write_jsonl
from helpers import CHAT as CHAT_ROWS


def test_alpaca_labels_mask_exactly_the_prompt_and_keep_eos(tokenizer):
    record = {"instruction": "Name a primary colour.", "input": "", "output": "Red."}
    sample, status = tokenize_one(tokenizer, "alpaca", record)
    prompt_ids = tokenizer(ALPACA_NO_INPUT.format(instruction=record["instruction"], input=""))["input_ids"]
    answer_ids = tokenizer("Red.", add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id and status == KEPT
    assert sample.input_ids == prompt_ids + answer_ids + [tokenizer.eos_token_id]
    assert sample.labels == [IGNORE] * len(prompt_ids) + answer_ids + [tokenizer.eos_token_id]


def test_train_on_prompt_labels_everything(tokenizer):
    sample, _ = tokenize_one(tokenizer, "alpaca", {"instruction": "Say hi.", "input": "", "output": "hi"}, train_on_prompt=True)
    # All but the first token, which nothing precedes (packed, it would follow another sample).
    assert sample.labels == [IGNORE] + sample.input_ids[1:]


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "6."},
]


def test_chat_labels_only_assistant_turns(tokenizer):
    sample, _ = tokenize_one(tokenizer, "messages", {"messages": CHAT})
    # The whole conversation, as the chat template renders it, is what the model sees.
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    eos = tokenizer.eos_token
    assert trained_spans(tokenizer, sample) == [f"It is 4.{eos}\n", f"6.{eos}\n"]
    assert sample.input_ids[0] == tokenizer.bos_token_id and sample.input_ids.count(tokenizer.bos_token_id) == 1


def test_sharegpt_is_the_same_conversation(tokenizer):
    turns = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in CHAT]
    assert detect(["conversations", "id"], "d").NAME == "sharegpt"
    sharegpt, _ = tokenize_one(tokenizer, "sharegpt", {"conversations": turns})
    messages, _ = tokenize_one(tokenizer, "messages", {"messages": CHAT})
    assert sharegpt == messages
    # LLaMA-Factory's layout: the system prompt in a column of its own.
    separate, _ = tokenize_one(tokenizer, "sharegpt", {"conversations": turns[1:], "system": "Be brief."})
    assert separate == messages


def test_openai_messages_with_tool_calls_and_content_parts(tiny_model_no_template):
    """The fallback template renders tools: the assistant's call is trained, the tool's result is not."""
    tok = load_tokenizer(str(tiny_model_no_template))
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 plus 2?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 4."},
    ]
    sample, _ = tokenize_one(tok, "messages", {"messages": messages})
    text = tok.decode(sample.input_ids)
    assert "### User:\nWhat is 2 plus 2?" in text and "### Tool result:\n4" in text
    spans = trained_spans(tok, sample)
    assert len(spans) == 2 and '"name": "add"' in spans[0] and spans[1].startswith("It is 4.")
    assert "Tool result" not in "".join(spans)
    # ShareGPT's function_call / observation turns are the same thing.
    turns = [
        {"from": "human", "value": "What is 2 plus 2?"},
        {"from": "function_call", "value": json.dumps(call["function"])},
        {"from": "observation", "value": "4"},
        {"from": "gpt", "value": "It is 4."},
    ]
    assert trained_spans(tok, tokenize_one(tok, "sharegpt", {"conversations": turns})[0]) == spans


def test_tool_calls_need_a_template_that_renders_them(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(UserError, match="no tool support"):
        tokenize_one(tokenizer, "messages", {"messages": messages})


def test_image_parts_for_a_text_only_base_are_refused_by_row(tokenizer):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "assistant", "content": "a cat"}]
    with pytest.raises(UserError, match="d.jsonl: row 1: the row has images but --base is a text-only model"):
        tokenize_one(tokenizer, "messages", {"messages": messages})
    audio = [{"role": "user", "content": [{"type": "audio", "audio": "x.wav"}]}, {"role": "assistant", "content": "a cat"}]
    with pytest.raises(UserError, match="d.jsonl: row 1: messages\\[0\\]: a content part of type 'audio'"):
        tokenize_one(tokenizer, "messages", {"messages": audio})


def test_chat_without_template_uses_documented_fallback(tiny_model_no_template):
    tok = load_tokenizer(str(tiny_model_no_template))
    assert tok.chat_template is None
    sample, _ = tokenize_one(tok, "messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    text = tok.decode(sample.input_ids)
    assert "### User:\nhi" in text and "### Assistant:\nyo" in text
    answer = tok.decode([t for t in sample.labels if t != IGNORE])
    assert answer.startswith("yo") and tok.eos_token in answer


def test_prompt_completion_and_text(tokenizer):
    pc, _ = tokenize_one(tokenizer, "prompt_completion", {"prompt": "Count:", "completion": " 1 2 3"})
    n_prompt = len(tokenizer("Count:")["input_ids"])
    assert pc.labels[:n_prompt] == [IGNORE] * n_prompt
    assert pc.labels[n_prompt:] == pc.input_ids[n_prompt:]
    assert pc.input_ids[-1] == tokenizer.eos_token_id
    text, _ = tokenize_one(tokenizer, "text", {"text": "hello world"})
    assert text.labels == [IGNORE] + text.input_ids[1:] and text.input_ids[-1] == tokenizer.eos_token_id


def test_pretokenized_rows_keep_their_labels_and_drop_padding(tokenizer):
    plain, _ = tokenize_one(tokenizer, "pretokenized", {"input_ids": [1, 40, 41, 2]})
    assert plain == Sample([1, 40, 41, 2], [IGNORE, 40, 41, 2])  # no EOS added: the ids are the user's
    labelled, _ = tokenize_one(
        tokenizer,
        "pretokenized",
        {"input_ids": [1, 40, 41, 2, 0, 0], "labels": [IGNORE, IGNORE, 41, 2, IGNORE, IGNORE], "attention_mask": [1, 1, 1, 1, 0, 0]},
    )
    assert labelled == Sample([1, 40, 41, 2], [IGNORE, IGNORE, 41, 2])
    with pytest.raises(UserError, match="token id 99999 is outside the tokenizer's vocabulary"):
        tokenize_one(tokenizer, "pretokenized", {"input_ids": [1, 99999]})


@pytest.mark.parametrize(
    "columns,expected",
    [
        (["text"], "text"),
        (["instruction", "input", "output"], "alpaca"),
        (["instruction", "output"], "alpaca"),
        (["messages", "id"], "messages"),
        (["conversations"], "sharegpt"),
        (["prompt", "completion"], "prompt_completion"),
        (["input_ids", "labels", "text"], "pretokenized"),
    ],
)
def test_detect_format(columns, expected):
    assert detect(columns, "d").NAME == expected


def test_unknown_columns_list_accepted_formats_and_the_mapping_fix():
    with pytest.raises(UserError, match="instruction \\+ output.*--data-columns"):
        detect(["question", "answer"], "d.jsonl")


# --- preference pairs and KTO rows ---------------------------------------------------------------
PAIR = {"prompt": "Pick a colour:", "chosen": " red", "rejected": " a green one"}


def sequences_of(sample: Sample) -> list[tuple[list[int], list[int]]]:
    bounds = [*sample.starts, len(sample.input_ids)]
    return [(sample.input_ids[a:b], sample.labels[a:b]) for a, b in zip(bounds, bounds[1:])]


def test_a_plain_text_pair_is_two_sequences_scored_on_their_answers_only(tokenizer):
    sample, status = tokenize_one(tokenizer, "preference", PAIR, objective="dpo")
    prompt = tokenizer(PAIR["prompt"])["input_ids"]
    eos = tokenizer.eos_token_id
    assert status == KEPT and len(sample.starts) == 2
    for (ids, labels), side in zip(sequences_of(sample), ("chosen", "rejected")):
        answer = tokenizer(PAIR[side], add_special_tokens=False)["input_ids"] + [eos]
        assert ids == prompt + answer  # what TRL's DPOTrainer feeds: prompt, answer, EOS
        assert labels == [IGNORE] * len(prompt) + answer


CONVERSATION = [{"role": "user", "content": "Pick a colour."}]


@pytest.mark.parametrize(
    "record",
    [
        {
            "prompt": CONVERSATION,
            "chosen": [{"role": "assistant", "content": "Red."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        },
        # UltraFeedback: whole conversations, the shared first turns are the prompt
        {
            "chosen": CONVERSATION + [{"role": "assistant", "content": "Red."}],
            "rejected": CONVERSATION + [{"role": "assistant", "content": "No."}],
        },
        # a string prompt beside message answers is one user turn
        {
            "prompt": "Pick a colour.",
            "chosen": [{"role": "assistant", "content": "Red."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        },
    ],
    ids=["prompt-column", "ultrafeedback", "string-prompt"],
)
def test_conversational_pairs_render_with_the_chat_template(tokenizer, record):
    sample, status = tokenize_one(tokenizer, "preference", record, objective="dpo")
    assert status == KEPT
    eos = tokenizer.eos_token
    for (ids, labels), answer in zip(sequences_of(sample), ("Red.", "No.")):
        whole = CONVERSATION + [{"role": "assistant", "content": answer}]
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(whole, tokenize=False)
        assert trained_spans(tokenizer, Sample(ids, labels)) == [f"{answer}{eos}\n"]


@pytest.mark.parametrize(
    "columns,expected",
    [
        (["prompt", "chosen", "rejected"], "preference"),
        (["chosen", "rejected", "score"], "preference"),
        (["prompt", "completion", "label"], "unpaired_preference"),
        (["prompt", "completion"], "prompt_completion"),
    ],
)
def test_detect_preference_formats(columns, expected):
    assert detect(columns, "d").NAME == expected


@pytest.mark.parametrize(
    "fmt,record,message",
    [
        ("preference", {"prompt": "Q", "chosen": "A", "rejected": ""}, r"row 1: 'rejected' is missing or empty"),
        ("preference", {"prompt": None, "chosen": "A", "rejected": "B"}, r"row 1: plain-text pairs need a 'prompt' column"),
        (
            "preference",
            {"chosen": [{"role": "assistant", "content": "A"}], "rejected": [{"role": "assistant", "content": "B"}]},
            "share no prompt",
        ),
        ("unpaired_preference", {"prompt": "Q", "completion": "A", "label": "yes"}, r"row 1: 'label' must be true .* got 'yes'"),
        ("unpaired_preference", {"prompt": "Q", "completion": "", "label": True}, r"row 1: 'completion' is missing or empty"),
    ],
)
def test_bad_preference_rows_name_the_row(tokenizer, fmt, record, message):
    with pytest.raises(UserError, match=message):
        tokenize_one(tokenizer, fmt, record, objective="kto" if fmt == "unpaired_preference" else "dpo")


def test_kto_rows_carry_their_label_and_a_kl_sequence_of_the_previous_rows_answer(tokenizer):
    rows = [{"prompt": "Q1", "completion": " one", "label": True}, {"prompt": "Q2", "completion": " two", "label": False}]
    (first, _), (second, _) = tokenize_rows(tokenizer, "unpaired_preference", rows, objective="kto")
    assert (first.label, second.label) == (1, 0)
    own, kl = sequences_of(second)
    assert tokenizer.decode(own[0], skip_special_tokens=True) == "Q2 two"
    assert tokenizer.decode(kl[0], skip_special_tokens=True) == "Q2 one"  # TRL's rotation: the previous row's answer
    assert tokenizer.decode(sequences_of(first)[1][0], skip_special_tokens=True) == "Q1 two"  # the first takes the last's


def test_rows_of_two_formats_in_one_file_are_named_with_the_first_row_of_each(tmp_path, tokenizer):
    """Alpaca rows then chat rows in one file loaded as one table with every column, detected as chat, and
    the first alpaca row was refused with "'messages' must be a non-empty list" (issue 52)."""
    path = write_jsonl(tmp_path / "mixed.jsonl", ALPACA[:3] + CHAT_ROWS[:2])
    with pytest.raises(UserError) as refused:
        prepare_data(data_config(path), tokenizer)
    assert str(refused.value) == (
        f"--data: {path} mixes data formats: alpaca rows (instruction, output) from row 1, messages rows (messages) from row 4; "
        "a source holds one format: put each in its own file and give them all to --data"
    )
