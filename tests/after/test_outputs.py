"""The one guard of what the commands after training write (`lora_tune.after.outputs`): merge, export
in every format, report and eval never write a run, a base, their own inputs, the current folder or a
folder lora-tune did not write, --overwrite or not; in a run's folder they replace only a file of
their own kind; a folder lora-tune wrote is replaced with --overwrite."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lora_tune.after.outputs import MARK
from lora_tune.cli import main

from helpers import ALPACA, fast_train_args, run_cli, single_error_line, tree_digest, write_jsonl


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory) -> Path:
    """A base and a finished 2-step run with its checkpoints, by relative paths (each case runs in a copy)."""
    root = tmp_path_factory.mktemp("outputs-world")
    shutil.copytree(tiny_model, root / "base")
    write_jsonl(root / "alpaca.jsonl", ALPACA)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main([str(a) for a in fast_train_args(Path("base"), Path("alpaca.jsonl"), Path("run"), max_steps=2, save_steps=1)]) == 0
    finally:
        os.chdir(cwd)
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("a user's own folder")
    return root


@pytest.fixture
def here(world, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "w"
    shutil.copytree(world, root, symlinks=True)
    monkeypatch.chdir(root)
    return root


# Each command with the output it is given; folder outputs also with --overwrite, which changes nothing here.
FOLDER_COMMANDS = {
    "merge": ["merge", "--adapter", "run", "--base", "base", "--dtype", "fp32", "--overwrite", "--output"],
    "export ollama": ["export", "run", "--base", "base", "--format", "ollama", "--overwrite", "--output"],
}
FOLDER_PLACES = {  # the data loss: export --format ollama --output RUN --overwrite emptied the run
    "the run": "run",
    "the run's parent": ".",
    "the base": "base",
    "a checkpoint": "run/checkpoint-1",
    "inside the run": "run/merged",
    "inside the base": "base/merged",
    "a folder lora-tune did not write": "mine",
}


@pytest.mark.parametrize("place", list(FOLDER_PLACES))
@pytest.mark.parametrize("command", list(FOLDER_COMMANDS))
def test_a_folder_output_never_replaces_what_is_not_its_own(command, place, here, capsys):
    before = tree_digest(here)
    code, _, err = run_cli([*FOLDER_COMMANDS[command], FOLDER_PLACES[place]], capsys)
    assert code == 2, err
    assert "never writes there, --overwrite or not" in single_error_line(err)
    assert tree_digest(here) == before


def test_the_current_folder_is_refused_up_front_not_busy_at_the_rename(here, capsys, monkeypatch):
    """`--output . --overwrite` from an empty folder failed at the end with 'Device or resource busy'."""
    (here / "empty").mkdir()
    monkeypatch.chdir(here / "empty")
    code, _, err = run_cli(["export", "../run", "--format", "ollama", "--output", ".", "--overwrite"], capsys)
    assert code == 2 and "is the current folder or holds it" in single_error_line(err)
    assert not list((here / "empty").iterdir())


FILE_COMMANDS = {
    "export gguf": (["export", "run", "--base", "base", "--overwrite", "--output"], ".gguf"),
    "report": (["report", "run", "--output"], ".png"),
    "eval": (["eval", "run", "--tasks", "arc_easy", "--output"], ".json"),
}
FILE_PLACES = {"inside a checkpoint": "run/checkpoint-1/out", "inside the base": "base/out", "beside the base's files": "base/model"}


@pytest.mark.parametrize("place", list(FILE_PLACES))
@pytest.mark.parametrize("command", list(FILE_COMMANDS))
def test_a_file_output_never_goes_into_a_checkpoint_or_a_base(command, place, here, capsys):
    argv, suffix = FILE_COMMANDS[command]
    before = tree_digest(here)
    code, _, err = run_cli([*argv, FILE_PLACES[place] + suffix], capsys)
    assert code == 2, err
    assert "never writes there" in single_error_line(err)
    assert tree_digest(here) == before


def test_eval_never_replaces_a_file_of_the_run(here, capsys):
    before = tree_digest(here)
    code, _, err = run_cli(["eval", "run", "--tasks", "arc_easy", "--output", "run/adapter_config.json"], capsys)
    assert code == 2 and "is a file of the run in" in single_error_line(err)
    assert tree_digest(here) == before


def test_overwrite_replaces_a_folder_lora_tune_wrote(here, capsys):
    code, _, err = run_cli(["merge", "--adapter", "run", "--base", "base", "--dtype", "fp32", "--output", "merged"], capsys)
    assert code == 0, err
    assert (here / "merged" / MARK).is_file()
    (here / "merged" / "model.safetensors").write_bytes(b"stale")
    code, _, err = run_cli(["export", "run", "--format", "ollama", "--output", "merged", "--overwrite"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (here / "merged").iterdir()) == ["Modelfile", MARK, "model.gguf", "template_pieces.json"]
