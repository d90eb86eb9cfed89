"""Sources: local files of each kind and folders, column mapping, several sources with their own
weights and columns, a bad row named by source and row."""

from __future__ import annotations

import datasets
import pytest

from lora_tune.data.prepare import prepare_data
from lora_tune.errors import UserError

from helpers import ALPACA, CHAT, data_config, write_jsonl


def test_column_mapping_renames_for_any_format(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Name a colour.", "answer": "Red.", "id": i} for i in range(3)])
    prepared = prepare_data(data_config(path, data_columns="instruction=question,output=answer"), tokenizer)
    assert prepared.format == "alpaca" and len(prepared.train) == 3
    direct = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Name a colour.", "output": "Red."}] * 3)
    assert prepared.train[0] == prepare_data(data_config(direct), tokenizer).train[0]
    with pytest.raises(UserError, match="no column 'query' to map"):
        prepare_data(data_config(path, data_columns="instruction=query,output=answer"), tokenizer)


def test_formats_load_from_parquet_csv_and_folder(tmp_path, tokenizer):
    rows = [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"), index=False)
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", rows)
    write_jsonl(folder / "b.jsonl", rows)
    for source, n in [(tmp_path / "d.parquet", 2), (tmp_path / "d.csv", 2), (folder, 4)]:
        prepared = prepare_data(data_config(source), tokenizer)
        assert prepared.format == "prompt_completion" and len(prepared.train) == n


def test_yaml_sources_carry_their_own_weight_columns_and_split(tmp_path, tokenizer):
    q = write_jsonl(tmp_path / "q.jsonl", [{"q": f"question {i}", "a": "answer"} for i in range(10)])
    t = write_jsonl(tmp_path / "t.jsonl", [{"text": f"text {i}"} for i in range(10)])
    prepared = prepare_data(
        data_config([{"path": str(q), "weight": 1, "columns": {"prompt": "q", "completion": "a"}}, {"path": str(t), "weight": 1}]),
        tokenizer,
    )
    assert prepared.format == "prompt_completion+text" and len(prepared.train) == 20


def test_a_bad_row_names_the_source_and_the_row(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"conversations": [{"from": "narrator", "value": "x"}]},
        ],
    )
    with pytest.raises(UserError, match=r"--data .*bad.jsonl: row 2: conversations\[0\] is from 'narrator'"):
        prepare_data(data_config(path), tokenizer)


def test_a_folder_of_two_formats_names_its_files_and_their_formats(tmp_path, tokenizer):
    """alpaca.jsonl beside chat.jsonl: "could not load DIR: An error occurred while generating the dataset"."""
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "alpaca.jsonl", ALPACA)
    write_jsonl(tmp_path / "d" / "chat.jsonl", CHAT)
    with pytest.raises(UserError) as refused:
        prepare_data(data_config(tmp_path / "d"), tokenizer)
    assert str(refused.value) == (
        f"--data: folder {tmp_path / 'd'} mixes data formats: alpaca.jsonl is alpaca (instruction, input, output), chat.jsonl is "
        "messages (messages); give each file as its own --data source"
    )


def test_a_byte_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path, tokenizer):
    """A Latin-1 byte loaded unchecked and failed as "mixed column types", naming no row."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n{"text": "fine too"}\n')
    with pytest.raises(UserError) as refused:
        prepare_data(data_config(path), tokenizer)
    assert str(refused.value) == (
        f"--data: {path} line 2 is not UTF-8 text (byte 0xe9 at column 14); save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )
