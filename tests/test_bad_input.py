"""Every bad input ends in one `error:` line naming the culprit, exit code 2, no traceback, before
the model is loaded, with nothing written to disk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import fast_train_args, run_cli, single_error_line, write_jsonl


@pytest.fixture
def no_model_loading(monkeypatch):
    import lora_tune.engines

    def refuse(*a, **k):
        raise AssertionError("no engine may start (and load the model) for bad input")

    monkeypatch.setattr(lora_tune.engines, "create", refuse)


def _case(name, tmp_path: Path, tiny_model: Path, good: Path):
    """(argv, expected substring) for each bad input."""
    out = tmp_path / "out"
    base = dict(max_steps=1)
    if name == "missing data":
        return fast_train_args(tiny_model, tmp_path / "nope.jsonl", out, **base), "nope.jsonl does not exist"
    if name == "folder without data files":
        folder = tmp_path / "notes"
        folder.mkdir()
        (folder / "readme.txt").write_text("no data here")
        return fast_train_args(tiny_model, folder, out, **base), "holds no .jsonl/.json/.parquet/.csv files"
    if name == "unsupported extension":
        p = tmp_path / "data.txt"
        p.write_text("hello")
        return fast_train_args(tiny_model, p, out, **base), "unsupported extension"
    if name == "broken json line":
        p = tmp_path / "broken.jsonl"
        p.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
        return fast_train_args(tiny_model, p, out, **base), "line 3 is not valid JSON"
    if name == "unknown columns":
        p = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
        return fast_train_args(tiny_model, p, out, **base), "instruction + output (alpaca)"
    if name == "empty dataset":
        p = tmp_path / "empty.jsonl"
        p.write_text("")
        return fast_train_args(tiny_model, p, out, **base), "empty"
    if name == "malformed messages":
        p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}])
        return fast_train_args(tiny_model, p, out, **base), "role 'bot'"
    if name == "messages without assistant":
        p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
        return fast_train_args(tiny_model, p, out, **base), "no assistant message"
    if name == "rank 0":
        return fast_train_args(tiny_model, good, out, rank=0), "--rank: must be a positive integer"
    if name == "negative rank":
        return fast_train_args(tiny_model, good, out, rank=-4), "--rank"
    if name == "unknown precision":
        return fast_train_args(tiny_model, good, out, precision="int3"), "--precision: got 'int3'"
    if name == "lr 0":
        return fast_train_args(tiny_model, good, out, lr=0), "--lr: must be > 0"
    if name == "max-seq-len 0":
        return fast_train_args(tiny_model, good, out, max_seq_len=0), "--max-seq-len"
    if name == "unknown alias":
        return fast_train_args("llama-7b", good, out), "unknown model alias 'llama-7b'"
    if name == "missing base dir":
        return fast_train_args(tmp_path / "no-model", good, out), "no-model does not exist"
    if name == "unknown config key":
        cfg = tmp_path / "c.yaml"
        cfg.write_text("rnk: 8\n")
        return ["train", "--config", cfg, "--base", tiny_model, "--data", good, "--output-dir", out], "unknown key 'rnk' in"
    if name == "rank not a number":
        return fast_train_args(tiny_model, good, out, rank="abc"), "--rank"
    if name == "missing output dir":
        return ["train", "--base", tiny_model, "--data", good], "--output-dir is required"
    if name == "eval split out of range":
        return fast_train_args(tiny_model, good, out, eval_split=1.5), "--eval-split: must be in [0, 1)"
    if name == "zero max steps":
        return fast_train_args(tiny_model, good, out, max_steps=0), "--max-steps"
    if name == "zero micro batch":
        return fast_train_args(tiny_model, good, out, micro_batch_size=0), "--micro-batch-size"
    if name == "unknown scheduler":
        return fast_train_args(tiny_model, good, out, lr_scheduler="cosine_restarts"), "--lr-scheduler"
    if name == "unknown optimizer":
        return fast_train_args(tiny_model, good, out, optim="lion"), "--optim"
    if name == "reporter not installed":
        return fast_train_args(tiny_model, good, out, report_to="wandb"), "pip install wandb"
    if name == "invalid yaml":
        cfg = tmp_path / "bad.yaml"
        cfg.write_text("rank: [8\nlr: 1\n")
        return ["train", "--config", cfg, "--base", tiny_model, "--data", good, "--output-dir", out], "not valid YAML"
    if name == "missing config file":
        return ["train", "--config", tmp_path / "none.yaml", "--base", tiny_model, "--data", good, "--output-dir", out], "none.yaml does not exist"
    if name == "output dir is a file":
        f = tmp_path / "a-file"
        f.write_text("x")
        return fast_train_args(tiny_model, good, f), "is a file"
    if name == "hub dataset unreachable":
        return fast_train_args(tiny_model, "someone/no-such-dataset", out), "the dataset someone/no-such-dataset is not in the local Hugging Face cache"
    if name == "base folder without config":
        d = tmp_path / "not-a-model"
        d.mkdir()
        return fast_train_args(d, good, out), "has no config.json"
    if name == "bad column mapping":
        return fast_train_args(tiny_model, good, out, data_columns="instruction"), "--data-columns: 'instruction' is not NAME=COLUMN"
    if name == "mapped column missing":
        return fast_train_args(tiny_model, good, out, data_columns="text=body"), "has no column 'body' to map"
    if name == "weights do not match sources":
        return fast_train_args(tiny_model, good, out, data_weights=["1", "2"]), "--data-weights: 2 weights for 1 sources"
    if name == "sharegpt unknown speaker":
        p = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                                                {"conversations": [{"from": "narrator", "value": "x"}]}])
        return fast_train_args(tiny_model, p, out, **base), "sg.jsonl: row 2: conversations[0] is from 'narrator'"
    if name == "pretokenized ids out of vocabulary":
        p = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 5, 70000]}])
        return fast_train_args(tiny_model, p, out, **base), "token id 70000 is outside the tokenizer's vocabulary"
    if name == "activation offload on cpu":
        return fast_train_args(tiny_model, good, out, activation_offload=True), "--activation-offload needs a CUDA GPU"
    if name == "hub model not reachable":
        return fast_train_args("someone/no-such-model", good, out), "the model someone/no-such-model is not in the local Hugging Face cache"
    if name == "flash attention on cpu":
        return fast_train_args(tiny_model, good, out, attn_implementation="flash_attention_2"), "--attn-implementation flash_attention_2 needs a CUDA GPU"
    if name == "activation offload without checkpointing":
        return fast_train_args(tiny_model, good, out, activation_offload=True, gradient_checkpointing=False), "--activation-offload moves the inputs that gradient checkpointing keeps"
    raise KeyError(name)


CASES = ["missing data", "folder without data files", "unsupported extension", "broken json line", "unknown columns", "empty dataset", "malformed messages",
         "messages without assistant", "rank 0", "negative rank", "unknown precision", "lr 0", "max-seq-len 0", "unknown alias",
         "missing base dir", "unknown config key", "rank not a number", "missing output dir", "eval split out of range",
         "zero max steps", "zero micro batch", "unknown scheduler", "unknown optimizer", "reporter not installed", "invalid yaml",
         "missing config file", "output dir is a file", "hub dataset unreachable", "base folder without config", "bad column mapping",
         "mapped column missing", "weights do not match sources", "sharegpt unknown speaker", "pretokenized ids out of vocabulary",
         "flash attention on cpu", "activation offload without checkpointing", "hub model not reachable"]
if not torch.cuda.is_available():
    CASES.append("activation offload on cpu")


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_clear_error(name, tmp_path, tiny_model, data_files, capsys, no_model_loading):
    if name == "reporter not installed" and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    argv, expected = _case(name, tmp_path, tiny_model, data_files["text"])
    before = sorted(tmp_path.rglob("*"))
    try:
        code, _, err = run_cli(argv, capsys)
    except SystemExit as e:  # argparse-level errors exit from inside the parser
        code, err = e.code, capsys.readouterr().err
    assert code == 2, err
    line = single_error_line(err)
    assert expected in line, line
    assert sorted(tmp_path.rglob("*")) == before, "a refused command must not write anything"
