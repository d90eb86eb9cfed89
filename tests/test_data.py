"""Data stage: every format's loss masks token by token, column mapping, mixing, the tokenized cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lora_tune.config import TrainConfig
from lora_tune.data import ALPACA_NO_INPUT, IGNORE, Sample, prepare_data
from lora_tune.data.formats import detect
from lora_tune.data.tokenize import DROPPED_LONG, DROPPED_NO_LABELS, KEPT, TRUNCATED, Tokenize
from lora_tune.errors import UserError
from lora_tune.model_loading import load_tokenizer

from conftest import write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))


def cfg(data="x.jsonl", **kw):
    return TrainConfig(base="tiny-llama", data=data if isinstance(data, list) else str(data), output_dir="out", **kw)


def one(tokenizer, fmt: str, record: dict, **options) -> tuple[Sample, int]:
    """One record through the tokenizing map function: (sample, status)."""
    out = Tokenize(tokenizer, fmt, cfg(**options), "d.jsonl")({k: [v] for k, v in record.items()}, [0])
    return Sample(out["input_ids"][0], out["labels"][0]), out["status"][0]


def trained_spans(tokenizer, sample: Sample) -> list[str]:
    spans, current = [], []
    for t in sample.labels + [IGNORE]:
        if t == IGNORE:
            if current:
                spans.append(tokenizer.decode(current))
            current = []
        else:
            current.append(t)
    return spans


def test_alpaca_labels_mask_exactly_the_prompt_and_keep_eos(tokenizer):
    record = {"instruction": "Name a primary colour.", "input": "", "output": "Red."}
    sample, status = one(tokenizer, "alpaca", record)
    prompt_ids = tokenizer(ALPACA_NO_INPUT.format(instruction=record["instruction"], input=""))["input_ids"]
    answer_ids = tokenizer("Red.", add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id and status == KEPT
    assert sample.input_ids == prompt_ids + answer_ids + [tokenizer.eos_token_id]
    assert sample.labels == [IGNORE] * len(prompt_ids) + answer_ids + [tokenizer.eos_token_id]


def test_train_on_prompt_labels_everything(tokenizer):
    sample, _ = one(tokenizer, "alpaca", {"instruction": "Say hi.", "input": "", "output": "hi"}, train_on_prompt=True)
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
    sample, _ = one(tokenizer, "messages", {"messages": CHAT})
    # The whole conversation, as the chat template renders it, is what the model sees.
    assert tokenizer.decode(sample.input_ids) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    eos = tokenizer.eos_token
    assert trained_spans(tokenizer, sample) == [f"It is 4.{eos}\n", f"6.{eos}\n"]
    assert sample.input_ids[0] == tokenizer.bos_token_id and sample.input_ids.count(tokenizer.bos_token_id) == 1


def test_sharegpt_is_the_same_conversation(tokenizer):
    turns = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in CHAT]
    assert detect(["conversations", "id"], "d").NAME == "sharegpt"
    sharegpt, _ = one(tokenizer, "sharegpt", {"conversations": turns})
    messages, _ = one(tokenizer, "messages", {"messages": CHAT})
    assert sharegpt == messages
    # LLaMA-Factory's layout: the system prompt in a column of its own.
    separate, _ = one(tokenizer, "sharegpt", {"conversations": turns[1:], "system": "Be brief."})
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
    sample, _ = one(tok, "messages", {"messages": messages})
    text = tok.decode(sample.input_ids)
    assert "### User:\nWhat is 2 plus 2?" in text and "### Tool result:\n4" in text
    spans = trained_spans(tok, sample)
    assert len(spans) == 2 and '"name": "add"' in spans[0] and spans[1].startswith("It is 4.")
    assert "Tool result" not in "".join(spans)
    # ShareGPT's function_call / observation turns are the same thing.
    turns = [{"from": "human", "value": "What is 2 plus 2?"}, {"from": "function_call", "value": json.dumps(call["function"])},
             {"from": "observation", "value": "4"}, {"from": "gpt", "value": "It is 4."}]
    assert trained_spans(tok, one(tok, "sharegpt", {"conversations": turns})[0]) == spans


def test_tool_calls_need_a_template_that_renders_them(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(UserError, match="no tool support"):
        one(tokenizer, "messages", {"messages": messages})


def test_image_parts_are_refused_by_row(tokenizer):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, {"role": "assistant", "content": "a cat"}]
    with pytest.raises(UserError, match="d.jsonl: row 1: messages\\[0\\]: a content part of type 'image_url'"):
        one(tokenizer, "messages", {"messages": messages})


def test_chat_without_template_uses_documented_fallback(tiny_model_no_template):
    tok = load_tokenizer(str(tiny_model_no_template))
    assert tok.chat_template is None
    sample, _ = one(tok, "messages", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    text = tok.decode(sample.input_ids)
    assert "### User:\nhi" in text and "### Assistant:\nyo" in text
    answer = tok.decode([t for t in sample.labels if t != IGNORE])
    assert answer.startswith("yo") and tok.eos_token in answer


def test_prompt_completion_and_text(tokenizer):
    pc, _ = one(tokenizer, "prompt_completion", {"prompt": "Count:", "completion": " 1 2 3"})
    n_prompt = len(tokenizer("Count:")["input_ids"])
    assert pc.labels[:n_prompt] == [IGNORE] * n_prompt
    assert pc.labels[n_prompt:] == pc.input_ids[n_prompt:]
    assert pc.input_ids[-1] == tokenizer.eos_token_id
    text, _ = one(tokenizer, "text", {"text": "hello world"})
    assert text.labels == [IGNORE] + text.input_ids[1:] and text.input_ids[-1] == tokenizer.eos_token_id


def test_pretokenized_rows_keep_their_labels_and_drop_padding(tokenizer):
    plain, _ = one(tokenizer, "pretokenized", {"input_ids": [1, 40, 41, 2]})
    assert plain == Sample([1, 40, 41, 2], [IGNORE, 40, 41, 2])  # no EOS added: the ids are the user's
    labelled, _ = one(tokenizer, "pretokenized", {"input_ids": [1, 40, 41, 2, 0, 0], "labels": [IGNORE, IGNORE, 41, 2, IGNORE, IGNORE],
                                                  "attention_mask": [1, 1, 1, 1, 0, 0]})
    assert labelled == Sample([1, 40, 41, 2], [IGNORE, IGNORE, 41, 2])
    with pytest.raises(UserError, match="token id 99999 is outside the tokenizer's vocabulary"):
        one(tokenizer, "pretokenized", {"input_ids": [1, 99999]})


@pytest.mark.parametrize("columns,expected", [
    (["text"], "text"),
    (["instruction", "input", "output"], "alpaca"),
    (["instruction", "output"], "alpaca"),
    (["messages", "id"], "messages"),
    (["conversations"], "sharegpt"),
    (["prompt", "completion"], "prompt_completion"),
    (["input_ids", "labels", "text"], "pretokenized"),
])
def test_detect_format(columns, expected):
    assert detect(columns, "d").NAME == expected


def test_unknown_columns_list_accepted_formats_and_the_mapping_fix():
    with pytest.raises(UserError, match="instruction \\+ output.*--data-columns"):
        detect(["question", "answer"], "d.jsonl")


def test_column_mapping_renames_for_any_format(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Name a colour.", "answer": "Red.", "id": i} for i in range(3)])
    prepared = prepare_data(cfg(path, data_columns="instruction=question,output=answer"), tokenizer)
    assert prepared.format == "alpaca" and len(prepared.train) == 3
    direct = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Name a colour.", "output": "Red."}] * 3)
    assert prepared.train[0] == prepare_data(cfg(direct), tokenizer).train[0]
    with pytest.raises(UserError, match="no column 'query' to map"):
        prepare_data(cfg(path, data_columns="instruction=query,output=answer"), tokenizer)


def test_long_samples_truncate_or_drop_are_counted(tmp_path, tokenizer):
    sample, status = one(tokenizer, "text", {"text": "word " * 200}, max_seq_len=32)
    assert status == TRUNCATED and len(sample.input_ids) == 32
    assert one(tokenizer, "text", {"text": "word " * 200}, max_seq_len=32, long_samples="drop")[1] == DROPPED_LONG
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * 200}, {"text": "short"}])
    prepared = prepare_data(cfg(path, max_seq_len=32, long_samples="drop"), tokenizer)
    assert prepared.stats.dropped_long == 1 and len(prepared.train) == 1


def test_fully_masked_samples_are_dropped_and_counted(tokenizer):
    # The prompt alone fills max_seq_len: after truncation no trainable token is left.
    assert one(tokenizer, "prompt_completion", {"prompt": "word " * 100, "completion": "x"}, max_seq_len=16)[1] == DROPPED_NO_LABELS


def test_a_source_with_no_usable_sample_is_refused_also_from_the_cache(tmp_path, tokenizer):
    # Nothing survives: the cache holds zero rows, which must read back as zero rows, not crash.
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "word " * 100, "completion": "x"}] * 3)
    for attempt in ("built", "cached"):
        with pytest.raises(UserError, match=r"^--data: no usable samples .*3 dropped with no trainable tokens\); raise --max-seq-len"):
            prepare_data(cfg(path, max_seq_len=16, data_cache_dir=str(tmp_path / "cache")), tokenizer)
        assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1, attempt


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


def test_sources_mix_in_their_weights_deterministically(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"instruction": f"beta {i}", "output": "ok"} for i in range(40)])
    mixed = prepare_data(cfg([str(a), str(b)], data_weights=[3.0, 1.0]), tokenizer)
    alpha = sum("alpha" in tokenizer.decode(s.input_ids) for s in mixed.train)
    assert len(mixed.train) == 80 and alpha == 60  # 3/4 of the combined size: the small share upsampled
    assert len({tuple(s.input_ids) for s in mixed.train if "beta" in tokenizer.decode(s.input_ids)}) == 20  # drawn without repetition
    again = prepare_data(cfg([str(a), str(b)], data_weights=[3.0, 1.0]), tokenizer)
    assert [s.input_ids for s in again.train] == [s.input_ids for s in mixed.train]
    assert mixed.format == "alpaca+text" and len(mixed.per_source) == 2 and "60 in the mix (weight 3.0)" in mixed.per_source[0]
    assert prepare_data(cfg([str(a), str(b)], data_weights=[1.0, 3.0]), tokenizer).fingerprint != mixed.fingerprint
    with pytest.raises(UserError, match="2 weights for 1 sources"):
        prepare_data(cfg([str(a)], data_weights=[1.0, 2.0]), tokenizer)


def test_yaml_sources_carry_their_own_weight_columns_and_split(tmp_path, tokenizer):
    q = write_jsonl(tmp_path / "q.jsonl", [{"q": f"question {i}", "a": "answer"} for i in range(10)])
    t = write_jsonl(tmp_path / "t.jsonl", [{"text": f"text {i}"} for i in range(10)])
    prepared = prepare_data(cfg([{"path": str(q), "weight": 1, "columns": {"prompt": "q", "completion": "a"}}, {"path": str(t), "weight": 1}]), tokenizer)
    assert prepared.format == "prompt_completion+text" and len(prepared.train) == 20


def test_the_cache_is_hit_by_a_second_run_and_missed_when_anything_changes(tmp_path, tokenizer, tiny_model_no_template, monkeypatch):
    import lora_tune.data as data

    path = write_jsonl(tmp_path / "c.jsonl", [{"text": f"cached {i}"} for i in range(10)])
    options = dict(data_cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg(path, **options), tokenizer)
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1

    def no_tokenizing(*a, **k):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(data, "Tokenize", no_tokenizing)
    second = prepare_data(cfg(path, **options), tokenizer)  # another run (any output folder, or a resume)
    assert [s.input_ids for s in second.train] == [s.input_ids for s in first.train] and second.fingerprint == first.fingerprint
    monkeypatch.undo()
    changes = [cfg(path, max_seq_len=64, **options), cfg(path, train_on_prompt=True, **options), cfg(path, long_samples="drop", **options)]
    for changed in changes:
        prepare_data(changed, tokenizer)
    prepare_data(cfg(path, **options), load_tokenizer(str(tiny_model_no_template)))  # another template
    write_jsonl(path, [{"text": f"changed {i}"} for i in range(10)])
    prepare_data(cfg(path, **options), tokenizer)
    assert len(list((tmp_path / "cache").glob("*/meta.json"))) == 1 + len(changes) + 2
    assert not list((tmp_path / "cache").glob(".*tmp*"))


def test_processes_share_one_build_of_a_source(tmp_path, tiny_model):
    """Two processes at once (as the ranks of a job): one tokenizes, the other waits and reads it."""
    path = write_jsonl(tmp_path / "s.jsonl", [{"text": f"shared {i}"} for i in range(200)])
    script = ("import sys, logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
              "from lora_tune.config import TrainConfig; from lora_tune.data import prepare_data; from lora_tune.model_loading import load_tokenizer\n"
              f"cfg = TrainConfig(base='b', data={str(path)!r}, output_dir='o', data_cache_dir={str(tmp_path / 'cache')!r})\n"
              f"print(len(prepare_data(cfg, load_tokenizer({str(tiny_model)!r})).train))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert [out.strip() for out, _ in outputs] == ["200", "200"]
    assert sum(err.count("data: tokenized") for _, err in outputs) == 1


def test_a_bad_row_names_the_source_and_the_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                                                {"conversations": [{"from": "narrator", "value": "x"}]}])
    with pytest.raises(UserError, match=r"--data .*bad.jsonl: row 2: conversations\[0\] is from 'narrator'"):
        prepare_data(cfg(path), tokenizer)
