"""The input checks before loading: an output folder is never overwritten, resume finds what to
continue and refuses changed math, the memory plan warns or refuses."""

from __future__ import annotations

import shutil

from helpers import fast_train_args, read_metrics, run_cli, single_error_line, write_jsonl


def test_refuses_to_overwrite_a_run(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=1), capsys)[0] == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=1), capsys)
    assert code == 2
    assert "already holds a run" in single_error_line(err) and "--resume" in err
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*")}


def test_resume_refuses_changed_math_and_lists_the_keys(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2), capsys)[0] == 0
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, rank=8, lr=1e-3, resume=True), capsys)
    assert code == 2
    line = single_error_line(err)
    assert "rank: 4 -> 8" in line and "lr: 0.005 -> 0.001" in line and "max_steps" not in line

    changed = write_jsonl(tmp_path / "other.jsonl", [{"text": "different content"}] * 12)
    # Same path, other content: the fingerprint catches it.
    shutil.copy(changed, data_files["text"])
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True), capsys)
    assert code == 2 and "data content (fingerprint)" in single_error_line(err)
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True, allow_config_change=True), capsys)
    assert code == 0, err


def test_resume_without_a_run_is_refused(tiny_model, data_files, tmp_path, capsys):
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "empty", resume=True), capsys)
    assert code == 2 and "no run to resume" in single_error_line(err)
    assert not (tmp_path / "empty").exists()


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_over(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "lora_tune_config.yaml").write_text("base: x\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (out / "checkpoint-1").mkdir()  # no COMPLETE marker: the kill came mid-save
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2, resume=True), capsys)
    assert code == 0, err
    assert "starting from step 0" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and read_metrics(out)[0]["loss"] != 9.0


def test_train_preflight_warns_or_refuses_when_the_plan_does_not_fit(tiny_model, data_files, tmp_path, capsys):
    huge = dict(max_seq_len=50_000_000, max_steps=1)  # planned for the worst case: full-length samples
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "strict", strict_memory=True, **huge), capsys)
    assert code == 2 and "--strict-memory" in single_error_line(err) and "lora-tune plan --auto" in err
    assert not (tmp_path / "strict").exists()
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "warn", **huge), capsys)
    assert code == 0 and "warning: the memory plan needs" in err
