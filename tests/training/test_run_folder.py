"""A training run's output folder (lora_tune.training.run_folder): never overwritten, never a model's folder,
never written through a link; resume finds what to continue and refuses changed math."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lora_tune.config import TrainConfig
from lora_tune.training import run_folder

from helpers import fast_train_args, read_metrics, run_cli, single_error_line, tmpfs, tree_digest, write_jsonl


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


def finished_run(tiny_model, data, out, capsys, **options) -> Path:
    code, _, err = run_cli(fast_train_args(tiny_model, data, out, max_steps=2, **options), capsys)
    assert code == 0, err
    return out


@pytest.mark.parametrize("where", ["the base itself", "inside the base", "a link to the base", "another model's folder"])
def test_an_output_dir_in_a_model_folder_is_refused_whatever_the_options(where, tiny_model, data_files, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    out = {
        "the base itself": base,
        "inside the base": base / "runs" / "mine",
        "a link to the base": tmp_path / "link",
        "another model's folder": other,
    }[where]
    (tmp_path / "link").symlink_to(base)
    before = tree_digest(tmp_path)
    for extra in ({}, {"resume": True}, {"allow_config_change": True, "resume": True}):
        code, _, err = run_cli(fast_train_args(base, data_files["text"], out, max_steps=1, **extra), capsys)
        assert code == 2, err
        line = single_error_line(err)
        assert ("base model's folder" in line or "holds a model (model.safetensors, config.json)" in line) and "--output-dir" in line
    assert tree_digest(tmp_path) == before


def test_resume_of_a_finished_run_whose_checkpoints_were_deleted_changes_nothing(tiny_model, data_files, tmp_path, capsys):
    out = finished_run(tiny_model, data_files["text"], tmp_path / "run", capsys)
    for checkpoint in out.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)  # a disk cleanup
    before = tree_digest(out)
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=4, resume=True), capsys)
    assert code == 2
    assert single_error_line(err) == "error: " + run_folder.FINISHED_RUN.format(out=out)
    assert f"--init-adapter {out} --output-dir NEW" in err
    assert tree_digest(out) == before, "nothing of the finished run may change"


def test_resume_checks_the_base_by_content_not_by_name(tiny_model, data_files, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    out = finished_run(base, data_files["text"], tmp_path / "run", capsys, save_steps=1)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert len(state["base_fingerprint"]) == 24
    moved = tmp_path / "moved-base"
    base.rename(moved)  # the same weights elsewhere: the same base
    code, _, err = run_cli(fast_train_args(moved, data_files["text"], out, max_steps=3, save_steps=1, resume=True), capsys)
    assert code == 0, err
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))  # changed in place, same name
    code, _, err = run_cli(fast_train_args(moved, data_files["text"], out, max_steps=4, save_steps=1, resume=True), capsys)
    assert code == 2 and "base model content (config and weights' fingerprint)" in single_error_line(err)


def test_resume_refuses_another_world_size_even_with_allow_config_change(tiny_model, data_files, tmp_path, capsys):
    out = finished_run(tiny_model, data_files["text"], tmp_path / "run", capsys)
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "world_size": 2}))  # as a 2-process job writes it
    for extra in ({}, {"allow_config_change": True}):
        code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=4, resume=True, **extra), capsys)
        assert code == 2
        line = single_error_line(err)
        assert "was written by 2 process(es) and this run has 1" in line and "Resume with --nproc 2" in line
        assert "provably computes the same run" in line


def test_the_world_size_a_resume_compares_is_the_jobs(monkeypatch):
    cfg = TrainConfig(base="b", data="d.jsonl", output_dir="o", nproc=4)
    assert run_folder.run_world_size(cfg) == 4  # the --nproc launcher checks before starting its ranks
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert run_folder.run_world_size(cfg) == 3  # inside a job: the launcher's world


@pytest.mark.parametrize("name", ["metrics.jsonl", "lora_tune_config.yaml", "tokenizer.json", "adapter_model.safetensors", "tensorboard"])
def test_a_symbolic_link_in_the_output_dir_is_refused_and_its_target_untouched(name, tiny_model, data_files, tmp_path, capsys):
    out = finished_run(tiny_model, data_files["text"], tmp_path / "run", capsys, save_steps=1)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine\n")
    target = precious if name == "tensorboard" else precious / "notes.txt"
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(target)
    before = tree_digest(tmp_path)
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True, save_steps=1), capsys)
    assert code == 2 and f"{out / name} is a symbolic link" in single_error_line(err)
    assert tree_digest(tmp_path) == before


def test_a_read_only_output_folder_is_one_line_before_loading(tiny_model, data_files, tmp_path, capsys):
    with tmpfs(tmp_path / "ro", size="1m", read_only=True) as disk:
        code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], disk / "run", max_steps=1), capsys)
    assert code == 2 and "is on a read-only file system; choose another --output-dir" in single_error_line(err)


def test_resume_reads_a_setting_the_checkpoint_predates_as_its_default(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2, save_steps=2), capsys)[0] == 0
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    for key in ("max_pixels", "min_pixels"):  # options added after such a checkpoint was written
        del state["math_config"][key]
    state_file.write_text(json.dumps(state))
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, max_pixels=4096, resume=True), capsys)
    assert code == 2 and "max_pixels: None -> 4096" in single_error_line(err)
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True), capsys)
    assert code == 0, err
