"""Checkpoint mechanics: atomic commit, cleanup on failure, rotation, incomplete folders."""

from __future__ import annotations

import pytest

from lora_tune import checkpoint as ckpt


def make(out, step, complete=True):
    with ckpt.CheckpointWriter(out, step) as tmp:
        (tmp / "payload").write_text(str(step))
    if not complete:
        (out / f"checkpoint-{step}" / ckpt.MARKER).unlink()


def test_commit_is_atomic_and_marker_is_written(tmp_path):
    make(tmp_path, 5)
    assert (tmp_path / "checkpoint-5" / ckpt.MARKER).is_file()
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_failure_inside_the_writer_leaves_previous_intact(tmp_path):
    make(tmp_path, 1)
    with pytest.raises(OSError):
        with ckpt.CheckpointWriter(tmp_path, 2) as tmp:
            (tmp / "half").write_text("x")
            raise OSError(28, "No space left on device")
    assert not (tmp_path / "checkpoint-2").exists()
    assert not list(tmp_path.glob(".checkpoint-*"))
    assert ckpt.newest_complete(tmp_path).name == "checkpoint-1"


def test_incomplete_folders_are_ignored_and_reported(tmp_path):
    make(tmp_path, 2)
    make(tmp_path, 4, complete=False)
    (tmp_path / ".checkpoint-6.tmp-123").mkdir()
    complete, incomplete = ckpt.list_checkpoints(tmp_path)
    assert [p.name for p in complete] == ["checkpoint-2"]
    assert [p.name for p in incomplete] == ["checkpoint-4"]
    assert ckpt.newest_complete(tmp_path).name == "checkpoint-2"


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
    with ckpt.CheckpointWriter(tmp_path, 3) as tmp:
        (tmp / "payload").write_text("new")
    assert (tmp_path / "checkpoint-3" / "payload").read_text() == "new"
    assert not list(tmp_path.glob(".checkpoint-*"))
