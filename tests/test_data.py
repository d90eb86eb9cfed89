"""Data stage: format detection, loss masks built by construction, EOS, padding, long samples."""

from __future__ import annotations

import pytest

from lora_tune.config import TrainConfig
from lora_tune.data import (
    ALPACA_NO_INPUT,
    IGNORE,
    Tokenization,
    detect_format,
    prepare_data,
    tokenize_all,
)
from lora_tune.errors import UserError
from lora_tune.model_loading import load_tokenizer

from conftest import write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def cfg(data="x.jsonl", **kw):
    return TrainConfig(base="tiny-llama", data=str(data), output_dir="out", **kw)


def test_alpaca_labels_mask_exactly_the_prompt_and_keep_eos(tokenizer):
    record = {"instruction": "Name a primary colour.", "input": "", "output": "Red."}
    sample = Tokenization(tokenizer, "alpaca", train_on_prompt=False)(record, 1)
    prompt_ids = tokenizer(ALPACA_NO_INPUT.format(instruction=record["instruction"], input=""))["input_ids"]
    answer_ids = tokenizer("Red.", add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id
    assert sample.input_ids == prompt_ids + answer_ids + [tokenizer.eos_token_id]
    assert sample.labels == [IGNORE] * len(prompt_ids) + answer_ids + [tokenizer.eos_token_id]


def test_train_on_prompt_labels_everything(tokenizer):
    record = {"instruction": "Say hi.", "input": "", "output": "hi"}
    sample = Tokenization(tokenizer, "alpaca", train_on_prompt=True)(record, 1)
    # All but the first token, which nothing precedes (packed, it would follow another sample).
    assert sample.labels == [IGNORE] + sample.input_ids[1:]


def test_chat_labels_only_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6."},
    ]
    sample = Tokenization(tokenizer, "messages", train_on_prompt=False)({"messages": messages}, 1)
    # The whole conversation, as the chat template renders it, is what the model sees.
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    trained = [t if t != IGNORE else None for t in sample.labels]
    spans, current = [], []
    for t in trained:
        if t is None:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(t)
    spans.append(current)
    eos = tokenizer.eos_token
    assert [tokenizer.decode(s) for s in spans if s] == [f"It is 4.{eos}\n", f"6.{eos}\n"]
    assert sample.input_ids[0] == tokenizer.bos_token_id
    assert sample.input_ids.count(tokenizer.bos_token_id) == 1


def test_chat_without_template_uses_documented_fallback(tiny_model_no_template):
    tok = load_tokenizer(str(tiny_model_no_template))
    assert tok.chat_template is None
    sample = Tokenization(tok, "messages", False)({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, 1)
    text = tok.decode(sample.input_ids)
    assert "### User:\nhi" in text and "### Assistant:\nyo" in text
    answer = tok.decode([t for t in sample.labels if t != IGNORE])
    assert answer.startswith("yo") and tok.eos_token in answer


def test_prompt_completion_and_text(tokenizer):
    pc = Tokenization(tokenizer, "prompt_completion", False)({"prompt": "Count:", "completion": " 1 2 3"}, 1)
    n_prompt = len(tokenizer("Count:")["input_ids"])
    assert pc.labels[:n_prompt] == [IGNORE] * n_prompt
    assert pc.labels[n_prompt:] == pc.input_ids[n_prompt:]
    assert pc.input_ids[-1] == tokenizer.eos_token_id
    text = Tokenization(tokenizer, "text", False)({"text": "hello world"}, 1)
    assert text.labels == [IGNORE] + text.input_ids[1:] and text.input_ids[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("columns,expected", [
    (["text"], "text"),
    (["instruction", "input", "output"], "alpaca"),
    (["instruction", "output"], "alpaca"),
    (["messages", "id"], "messages"),
    (["prompt", "completion"], "prompt_completion"),
])
def test_detect_format(columns, expected):
    assert detect_format(columns, "d") == expected


def test_unknown_columns_list_accepted_formats():
    with pytest.raises(UserError, match="instruction/input/output"):
        detect_format(["question", "answer"], "d.jsonl")


def test_long_samples_truncate_or_drop_are_counted(tokenizer):
    records = [{"text": "word " * 200}, {"text": "short"}]
    samples, stats = tokenize_all(records, tokenizer, "text", cfg(max_seq_len=32, long_samples="truncate"))
    assert stats.truncated == 1 and len(samples) == 2 and max(len(s.input_ids) for s in samples) == 32
    samples, stats = tokenize_all(records, tokenizer, "text", cfg(max_seq_len=32, long_samples="drop"))
    assert stats.dropped_long == 1 and len(samples) == 1


def test_fully_masked_samples_are_dropped_and_counted(tokenizer):
    # The prompt alone fills max_seq_len: after truncation no trainable token is left.
    records = [{"prompt": "word " * 100, "completion": "x"}, {"prompt": "a", "completion": "b"}]
    samples, stats = tokenize_all(records, tokenizer, "prompt_completion", cfg(max_seq_len=16))
    assert stats.dropped_no_labels == 1 and len(samples) == 1


def test_formats_load_from_parquet_csv_and_folder(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"), index=False)
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", rows)
    write_jsonl(folder / "b.jsonl", rows)
    for source, n in [(tmp_path / "d.parquet", 2), (tmp_path / "d.csv", 2), (folder, 4)]:
        prepared = prepare_data(cfg(source), tokenizer)
        assert prepared.format == "prompt_completion" and len(prepared.train) == n


def test_eval_split_is_disjoint_and_seeded(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"sample {i}"} for i in range(20)])
    a = prepare_data(cfg(path, eval_split=0.2), tokenizer)
    b = prepare_data(cfg(path, eval_split=0.2), tokenizer)
    assert len(a.eval) == 4 and len(a.train) == 16
    assert [s.input_ids for s in a.eval] == [s.input_ids for s in b.eval]
    assert not {tuple(s.input_ids) for s in a.eval} & {tuple(s.input_ids) for s in a.train}


def test_fingerprint_changes_with_content(tmp_path, tokenizer):
    p1 = write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    p2 = write_jsonl(tmp_path / "b.jsonl", [{"text": "one"}, {"text": "three"}])
    assert prepare_data(cfg(p1), tokenizer).fingerprint == prepare_data(cfg(p1), tokenizer).fingerprint
    assert prepare_data(cfg(p1), tokenizer).fingerprint != prepare_data(cfg(p2), tokenizer).fingerprint
