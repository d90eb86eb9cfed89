"""The metrics log: one JSON line per record, NaN written as it is, lines of steps to be redone
dropped on resume, each record handed to the callback; the peak memory figure."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from lora_tune.errors import UserError
from lora_tune.training.metrics import MetricsLog, check_reporter, peak_memory_bytes

from helpers import fast_train_args, read_metrics, run_cli


def test_records_are_json_lines_with_nan_kept_and_the_callback_called(tmp_path):
    seen = []
    log = MetricsLog(tmp_path, "none", {}, None, seen.append)
    log.write({"step": 1, "loss": float("nan"), "lr": 1e-3})
    log.write({"step": 2, "loss": 2.5, "lr": 1e-3})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": "nan", "lr": 1e-3}, {"step": 2, "loss": 2.5, "lr": 1e-3}]
    assert [r["step"] for r in seen] == [1, 2] and seen[0]["loss"] != seen[0]["loss"]  # the callback gets the float NaN


def test_resuming_drops_the_lines_of_steps_that_will_be_redone(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    log = MetricsLog(tmp_path, "none", {}, 2, None)
    log.write({"step": 3, "loss": 0.5})
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_peak_memory_of_this_process_is_counted():
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20


def test_a_reporter_that_is_not_installed_is_refused_before_anything_loads(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="--report-to wandb: the 'wandb' package is not installed"):
        check_reporter("wandb")
    check_reporter("none")


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    lines = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(lines + '{"step": 4, "loss": 0.9, "lr"')  # killed mid-append
    log = MetricsLog(tmp_path, "none", {}, 3, None)
    log.write({"step": 4, "loss": 0.5})
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_resume_after_a_kill_mid_append_continues_and_logs_each_step_once(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2, save_steps=1), capsys)[0] == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 2.71')
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, save_steps=1, resume=True), capsys)
    assert code == 0, err
    assert "Traceback" not in err and "dropped 1 unreadable line(s)" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
