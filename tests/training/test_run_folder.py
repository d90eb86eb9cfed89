"""A training run's output folder (lora_tune.training.run_folder): never overwritten, never a model's folder,
never written through a link; resume finds what to continue and refuses changed math."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lora_tune.cli import without_flags
from lora_tune.config import TrainConfig
from lora_tune.engines.state import load_safe_state
from lora_tune.training import run_folder

from helpers import (
    ROOT,
    adapter_tensors,
    assert_bit_identical,
    fast_train_args,
    read_metrics,
    run_cli,
    single_error_line,
    tmpfs,
    tree_digest,
    write_jsonl,
)


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
    code, _, err = run_cli(
        fast_train_args(tiny_model, data_files["text"], out, max_steps=3, weight_decay=0.1, lr=1e-3, resume=True), capsys
    )
    assert code == 2
    line = single_error_line(err)
    assert "weight_decay: 0.0 -> 0.1" in line and "lr: 0.005 -> 0.001" in line and "max_steps" not in line
    assert "--allow-config-change to continue with these (applied from the first resumed step)" in line

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
    assert code == 2 and "max_pixels: 1048576 -> 4096" in single_error_line(err)  # what the checkpoint computed: the default
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True), capsys)
    assert code == 0, err


# --- what a resume applies, and what it refuses (issue Q) ------------------------------------------
def copy_of_run_at(run: Path, step: int, dest: Path) -> Path:
    """A run folder as it was right after checkpoint-STEP: that checkpoint, the config and the metrics up to it."""
    dest.mkdir()
    shutil.copytree(run / f"checkpoint-{step}", dest / f"checkpoint-{step}")
    shutil.copy(run / "lora_tune_config.yaml", dest)
    lines = [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line).get("step", 0) <= step]
    (dest / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return dest


def optimizer_groups(checkpoint: Path) -> list[dict]:
    return load_safe_state(checkpoint, "training_state_rank0")["optimizer"]["param_groups"]


@pytest.fixture
def constant_run(tiny_model, data_files, tmp_path, capsys) -> Path:
    """4 steps at a constant learning rate, a checkpoint after each."""
    out = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, save_steps=1, lr_scheduler="constant"), capsys)
    assert code == 0, err
    return out


def test_a_changed_lr_or_weight_decay_is_applied_from_the_first_resumed_step(constant_run, tiny_model, data_files, tmp_path, capsys):
    before = adapter_tensors(constant_run / "checkpoint-3")
    updates = {}
    for name, change in (("same", {}), ("lr", {"lr": 1e-3}), ("weight_decay", {"weight_decay": 0.5})):
        out = copy_of_run_at(constant_run, 3, tmp_path / name)
        args = fast_train_args(tiny_model, data_files["text"], out, save_steps=1, lr_scheduler="constant", resume=True, **change)
        code, _, err = run_cli([*args, "--allow-config-change"] if change else args, capsys)
        assert code == 0, err
        after = adapter_tensors(out / "checkpoint-4")
        updates[name] = {k: after[k] - before[k] for k in before}
        groups = optimizer_groups(out / "checkpoint-4")
        assert {(g["lr"], g["initial_lr"], g["weight_decay"]) for g in groups} == {
            (change.get("lr", 5e-3), change.get("lr", 5e-3), change.get("weight_decay", 0.0))
        }
        assert read_metrics(out)[-1]["lr"] == change.get("lr", 5e-3)  # the rate step 4 ran at
        if change:
            key = next(iter(change))
            assert f"applied from step 4: {key} " in err
            state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
            assert state["config_changes"] == [{"step": 3, "changed": {key: [{"lr": 5e-3, "weight_decay": 0.0}[key], change[key]]}}]
    assert_bit_identical(adapter_tensors(tmp_path / "same" / "checkpoint-4"), adapter_tensors(constant_run / "checkpoint-4"))
    for k, same in updates["same"].items():
        # Adam's update is lr x m / sqrt(v): a fifth of the rate moves every element a fifth as far (atol: the
        # fp32 rounding of the weights each update is read back from, ~4e-9 at their size).
        torch.testing.assert_close(updates["lr"][k], same * 0.2, rtol=1e-4, atol=1e-8)
        # Decoupled weight decay shrinks each weight by lr x wd before the Adam update.
        torch.testing.assert_close(updates["weight_decay"][k] - same, -5e-3 * 0.5 * before[k], rtol=1e-3, atol=1e-8)
    assert all(same.abs().max() > 0 for same in updates["same"].values())


@pytest.mark.parametrize("stopped_at", [2, 4], ids=["mid-run", "finished"])
def test_a_lengthened_cosine_run_trains_its_first_resumed_step_at_the_new_schedule(stopped_at, tiny_model, data_files, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], run, save_steps=1, lr_scheduler="cosine"), capsys)
    assert code == 0, err
    out = run if stopped_at == 4 else copy_of_run_at(run, stopped_at, tmp_path / "stopped")
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, save_steps=1, max_steps=8, resume=True), capsys)
    assert code == 0, err
    step = stopped_at + 1
    expected = 5e-3 * 0.5 * (1 + math.cos(math.pi * stopped_at / 8))  # cosine over 8 steps, at step index stopped_at
    record = next(r for r in read_metrics(out) if r.get("step") == step and "loss" in r)
    assert record["lr"] == pytest.approx(expected, rel=1e-12)
    before, after = adapter_tensors(out / f"checkpoint-{stopped_at}"), adapter_tensors(out / f"checkpoint-{step}")
    assert all((after[k] - before[k]).abs().max() > 0 for k in before), "the first resumed step moved nothing"
    next_lr = 5e-3 * 0.5 * (1 + math.cos(math.pi * step / 8))  # what the checkpoint hands the step after it
    assert [g["lr"] for g in optimizer_groups(out / f"checkpoint-{step}")] == [pytest.approx(next_lr, rel=1e-12)]


@pytest.mark.parametrize(
    ("change", "key", "advice"),
    [
        ({"rank": 8}, "rank: 4 -> 8", "leave out --resume"),
        ({"dora": True}, "dora: False -> True", "leave out --resume"),
        ({"target_modules": ["q_proj"]}, "target_modules: None -> ['q_proj']", "leave out --resume"),
        ({"optim": "adamw_8bit"}, "optim: 'adamw' -> 'adamw_8bit'", "--init-adapter"),
        ({"zero": 2}, "zero: 0 -> 2", "--init-adapter"),
        ({"micro_batch_size": 1}, "micro_batch_size: 2 -> 1", "--init-adapter"),
        ({"grad_accum": 2}, "grad_accum: 1 -> 2", "--init-adapter"),
        ({"seed": 8}, "seed: 7 -> 8", "--init-adapter"),
    ],
)
def test_a_change_the_checkpoint_can_t_take_is_refused_before_loading(change, key, advice, constant_run, tiny_model, data_files, capsys):
    before = tree_digest(constant_run)
    for allow in (False, True):
        args = fast_train_args(tiny_model, data_files["text"], constant_run, max_steps=6, resume=True, allow_config_change=allow, **change)
        code, _, err = run_cli(args, capsys)
        assert code == 2, err
        line = single_error_line(err)
        assert f"can't continue with {key} (the checkpoint " in line and "--allow-config-change or not" in line and advice in line
        assert "data:" not in err  # refused before the data is even read
    assert tree_digest(constant_run) == before


def test_a_change_of_backend_on_two_ranks_is_refused_before_any_rank_starts(constant_run, tiny_model, data_files, capsys):
    # As a 2-process ZeRO-2 job writes it; resumed under FSDP2 or ZeRO-3, each rank's optimizer part would not load.
    state_file = constant_run / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "world_size": 2, "math_config": {**state["math_config"], "zero": 2}}))
    before = tree_digest(constant_run)
    for change, key in (({"backend": "fsdp"}, "zero: 2 -> 0"), ({"zero": 3}, "zero: 2 -> 3")):
        args = fast_train_args(tiny_model, data_files["text"], constant_run, max_steps=6, resume=True, nproc=2, **change)
        code, _, err = run_cli([*args, "--allow-config-change"], capsys)
        assert code == 2 and key in single_error_line(err) and "each rank's optimizer state" in err
    assert tree_digest(constant_run) == before


@pytest.mark.parametrize("length", [{"max_steps": 2}, {"epochs": 0.01}, {"max_steps": 4}])
def test_a_resume_with_no_step_left_is_refused_and_the_run_unchanged(length, constant_run, tiny_model, data_files, capsys):
    """Fewer steps than done: refused. As many (a requeued job's --resume after its run finished):
    nothing to do, exit 0, nothing written. The run is left as it is either way."""
    before = tree_digest(constant_run)
    args = fast_train_args(tiny_model, data_files["text"], constant_run, lr_scheduler="constant", resume=True, **length)
    code, _, err = run_cli(args if "max_steps" in length else without_flags(list(map(str, args)), "--max-steps"), capsys)
    if length == {"max_steps": 4}:
        assert code == 0, err
        line = [x for x in err.splitlines() if x.startswith("finished already: ")]
        assert len(line) == 1 and "nothing to train, nothing written" in line[0], err
    else:
        assert code == 2
        line = [single_error_line(err)]
    assert f"{constant_run / 'checkpoint-4'} is at step 4" in line[0] and "to train further, raise --" in line[0]
    assert tree_digest(constant_run) == before


def test_a_run_killed_while_finishing_resumes_to_finish_it(constant_run, tiny_model, data_files, capsys):
    # Killed after its final checkpoint, while writing the tokenizer: the lock keeps the killed
    # process's note, and the tokenizer is half there. The resume trains nothing and finishes.
    adapter = adapter_tensors(constant_run)
    metrics = read_metrics(constant_run)
    (constant_run / ".lora-tune.lock").write_text("pid 123 on host since 2026-12-07 10:00:00\n")
    (constant_run / "tokenizer.json").unlink()
    args = fast_train_args(tiny_model, data_files["text"], constant_run, lr_scheduler="constant", save_steps=1, resume=True)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert "the end of the run: nothing to train; finishing the run" in err
    assert (constant_run / "tokenizer.json").is_file()
    assert_bit_identical(adapter_tensors(constant_run), adapter)
    assert read_metrics(constant_run) == metrics  # no step trained, none logged twice
    # Finished cleanly this time: a further resume has nothing to do, and writes nothing.
    before = tree_digest(constant_run)
    code, _, err = run_cli(args, capsys)
    assert code == 0 and "finished already: " in err and "the end of the run (--max-steps 4)" in err
    assert tree_digest(constant_run) == before


def test_resume_from_a_chosen_checkpoint_continues_it_in_a_new_folder(constant_run, tiny_model, data_files, tmp_path, capsys):
    before = tree_digest(constant_run)
    args = {"save_steps": 1, "lr_scheduler": "constant"}
    chosen = constant_run / "checkpoint-2"
    # In its own run, newer checkpoints would be overwritten: refused, naming them.
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], constant_run, resume=str(chosen), **args), capsys)
    assert code == 2 and "holds newer checkpoints (checkpoint-3, checkpoint-4)" in single_error_line(err)
    assert f"--resume {chosen} --output-dir NEW" in err
    for bad, words in ((constant_run, "is not a checkpoint folder"), (tmp_path / "nowhere", "is not a folder")):
        code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "new", resume=str(bad), **args), capsys)
        assert code == 2 and words in single_error_line(err)
    new = tmp_path / "new"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], new, resume=str(chosen), **args), capsys)
    assert code == 0, err
    assert f"resumed from {chosen} (step 2)" in err
    assert tree_digest(constant_run) == before  # the run it came from is untouched
    assert_bit_identical(adapter_tensors(new), adapter_tensors(constant_run))  # and continued exactly
    assert [r["loss"] for r in read_metrics(new) if "loss" in r] == [r["loss"] for r in read_metrics(constant_run) if "loss" in r]
    assert sorted(p.name for p in new.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    # Continued once more, the new folder holds a run: only --resume alone continues it.
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], new, max_steps=5, resume=str(chosen), **args), capsys)
    assert code == 2 and "already holds a run; continue that one with --resume alone" in single_error_line(err)


def test_the_docs_list_what_may_change_on_resume_from_the_options_own_tags():
    table = run_folder.resume_table(TrainConfig)
    assert table in (ROOT / "docs" / "reference" / "resume.md").read_text()
    assert "`lr`" in table.split("allow-config-change")[1].splitlines()[0] and "`rank` |" not in table.split("refused")[0]
