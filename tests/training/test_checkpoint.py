"""Checkpoint mechanics: atomic commit, cleanup on failure, rotation, incomplete folders, the trainer
state, the pickle-free state format, and the output folder's lock."""

from __future__ import annotations

import shutil

import pytest

from lora_tune.errors import UserError
from lora_tune.files import write_json
from lora_tune.training import checkpoint as ckpt

from helpers import fast_train_args, run_cli, tree_digest


def make(out, step, complete=True):
    writer = ckpt.CheckpointWriter(out, step)
    (writer.begin() / "payload").write_text(str(step))
    writer.commit()
    if not complete:
        (out / f"checkpoint-{step}" / ckpt.MARKER).unlink()


def test_commit_is_atomic_and_marker_is_written(tmp_path):
    make(tmp_path, 5)
    assert (tmp_path / "checkpoint-5" / ckpt.MARKER).is_file()
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_a_failing_part_leaves_the_previous_checkpoint_intact(tmp_path):
    make(tmp_path, 1)

    def full_disk(folder):
        (folder / "half").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        ckpt.write(tmp_path, 2, None, full_disk, lambda folder: None)
    assert not (tmp_path / "checkpoint-2").exists()
    assert not list(tmp_path.glob(".checkpoint-*"))
    assert ckpt.newest_complete(tmp_path).name == "checkpoint-1"


def test_write_puts_every_part_in_one_complete_checkpoint_and_rotates(tmp_path):
    for step in (1, 2, 3):
        removed = ckpt.write(tmp_path, step, 2, lambda f: (f / "rank0").write_text("r"), lambda f: (f / "main").write_text("m"))
    assert [p.name for p in removed] == ["checkpoint-1"]
    assert sorted(p.name for p in (tmp_path / "checkpoint-3").iterdir()) == [ckpt.MARKER, "main", "rank0"]


def test_incomplete_folders_are_ignored_and_reported(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 4, complete=False)
    (tmp_path / ".checkpoint-6.tmp-123").mkdir()
    complete, incomplete = ckpt.list_checkpoints(tmp_path)
    assert [p.name for p in complete] == ["checkpoint-2"]
    assert [p.name for p in incomplete] == ["checkpoint-4"]
    assert ckpt.newest_complete(tmp_path).name == "checkpoint-2"
    assert ckpt.remove_leftovers(tmp_path) == [tmp_path / ".checkpoint-6.tmp-123"] and not (tmp_path / ".checkpoint-6.tmp-123").exists()


def test_rotation_never_removes_the_newest_complete(tmp_path):
    for step in (10, 20, 30):
        make(tmp_path, step)
    make(tmp_path, 40, complete=False)
    removed = ckpt.rotate(tmp_path, keep=1)
    assert [p.name for p in removed] == ["checkpoint-10", "checkpoint-20"]
    assert ckpt.newest_complete(tmp_path).name == "checkpoint-30"
    assert (tmp_path / "checkpoint-40").exists()  # incomplete ones are not counted nor removed here


def test_resaving_a_step_replaces_it_whole(tmp_path):
    make(tmp_path, 3)
    writer = ckpt.CheckpointWriter(tmp_path, 3)
    (writer.begin() / "payload").write_text("new")
    writer.commit()
    assert (tmp_path / "checkpoint-3" / "payload").read_text() == "new"
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_trainer_state_round_trips_through_json(tmp_path):
    state = ckpt.TrainerState(step=7, tokens_seen=1234, bad_steps_in_a_row=1, best_eval_loss=0.5)
    write_json(tmp_path / "trainer_state.json", {**vars(state), "world_size": 2})
    assert ckpt.TrainerState.saved(ckpt.read_json(tmp_path / "trainer_state.json")) == state


def test_the_lock_refuses_a_second_holder_and_is_released(tmp_path):
    first = ckpt.OutputLock(tmp_path).acquire()
    assert "pid" in ckpt.lock_holder(tmp_path)
    with pytest.raises(UserError, match="is being written by another lora-tune run"):
        ckpt.OutputLock(tmp_path).acquire()  # the same process, another open file: flock says no
    first.release()
    assert ckpt.lock_holder(tmp_path) is None and (tmp_path / ckpt.LOCK_NAME).read_text() == ""


def test_rotation_unlinks_a_linked_checkpoint_and_never_touches_its_target(tmp_path):
    other, mine = tmp_path / "other-run", tmp_path / "mine"
    for step in (1, 2):
        make(other, step)
    mine.mkdir()
    for step in (1, 2):
        (mine / f"checkpoint-{step}").symlink_to(other / f"checkpoint-{step}")
    before = tree_digest(other)
    make(mine, 3)
    removed = ckpt.rotate(mine, keep=1)
    assert [p.name for p in removed] == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoint-3"]
    assert tree_digest(other) == before and ckpt.newest_complete(other).name == "checkpoint-2"


def test_cleanup_unlinks_links_left_where_temporary_folders_go(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".checkpoint-4.tmp-4").symlink_to(precious)
    writer = ckpt.CheckpointWriter(out, 4)
    (writer.begin() / "payload").write_text("4")  # over a planted link: the link goes, not the folder
    writer.commit()
    (out / ".checkpoint-6.old-1").symlink_to(precious)
    assert ckpt.remove_leftovers(out) == [out / ".checkpoint-6.old-1"]
    assert (precious / "data").read_text() == "keep" and (out / "checkpoint-4" / "payload").read_text() == "4"


@pytest.mark.parametrize("target", ["a file", "a missing file", "a folder"])
def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_nothing_is_written_through_it(target, tmp_path):
    precious = tmp_path / "precious"
    if target == "a file":
        precious.write_text("a year of notes\n")
    elif target == "a folder":
        precious.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (out / ckpt.LOCK_NAME).symlink_to(precious)
    before = tree_digest(tmp_path)
    with pytest.raises(UserError, match=r"\.lora-tune\.lock is a symbolic link .*never writes through links"):
        ckpt.lock_holder(out)
    with pytest.raises(UserError, match="is a symbolic link"):
        ckpt.OutputLock(out).acquire()
    assert tree_digest(tmp_path) == before and not (target == "a missing file" and precious.exists())


def test_a_checkpoint_linked_into_another_run_is_unlinked_by_rotation_and_that_run_still_resumes(tiny_model, data_files, tmp_path, capsys):
    other = tmp_path / "other"
    args = dict(max_steps=2, save_steps=1)
    assert run_cli(fast_train_args(tiny_model, data_files["text"], other, **args), capsys)[0] == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    for f in other.iterdir():
        if f.name.startswith("checkpoint-"):
            (mine / f.name).symlink_to(f)
        elif f.is_file() and f.name != ckpt.LOCK_NAME:
            shutil.copy2(f, mine / f.name)
    before = tree_digest(other)
    resume = fast_train_args(tiny_model, data_files["text"], mine, max_steps=4, save_steps=1, save_total_limit=1, resume=True)
    code, _, err = run_cli(resume, capsys)
    assert code == 0, err
    assert "removed old checkpoint(s)" in err
    assert tree_digest(other) == before, "the other run's files must not change"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], other, max_steps=3, save_steps=1, resume=True), capsys)
    assert code == 0 and f"resumed from {other / 'checkpoint-2'} (step 2)" in err
