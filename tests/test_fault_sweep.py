"""The fault sweep: what a hostile user or a bad day does to every file and folder a command reads or
writes (truncated, emptied, garbage, a link, a dangling link, a folder in a file's place, a read-only
disk), across `train`, `train --resume`, `merge`, `export`, `eval`, `plan`, `report` and the Python API.
For each case: no traceback, the documented exit code (2: bad input, one `error:` line; 0: the fault is
harmless, e.g. a file read through a link, a damaged cache entry rebuilt), and not a byte changed in any
file outside the command's own output (the trees are hashed before and after). Kills during each stage
are below, in subprocesses."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import lora_tune
from lora_tune.cli import main
from lora_tune.errors import UserError

from helpers import ALPACA, metrics_lines, read_metrics, single_error_line, tmpfs, tree_digest, write_jsonl

# The world a user has: a base model, data, a config, eval prompts, and a finished run of that config
# (with its tokenized data cached). Paths are relative: each case runs in a copy of it, as its cwd.
CONFIG = {
    "base": "base",
    "data": "data.jsonl",
    "eval_prompts": "prompts.jsonl",
    "data_cache_dir": "cache",
    "precision": "fp32",
    "optim": "adamw",
    "rank": 4,
    "lr": 5e-3,
    "micro_batch_size": 2,
    "max_seq_len": 128,
    "seed": 7,
    "max_steps": 2,
    "save_steps": 1,
    "eval_steps": 2,
    "eval_max_new_tokens": 4,
}


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("world")
    shutil.copytree(tiny_model, root / "base")
    write_jsonl(root / "data.jsonl", ALPACA)
    write_jsonl(root / "prompts.jsonl", [{"prompt": "Add 1 and 2."}, {"instruction": "Say hi."}])
    (root / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (root / "tasks").mkdir()  # an lm-eval task of local data, by a path relative to the world (each case runs in a copy)
    write_jsonl(
        root / "tasks" / "add.jsonl", [{"question": f"Add {a} and 1.", "choices": [f"{a + 1}", f"{a + 2}"], "answer": 0} for a in range(4)]
    )
    (root / "tasks" / "tiny_add.yaml").write_text(
        "task: tiny_add\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: tasks/add.jsonl\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["train", "--config", "config.yaml", "--output-dir", "run"]) == 0
    finally:
        os.chdir(cwd)
    return root


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    own: tuple[str, ...]  # what the command writes: its output (and lora-tune's data cache)
    reads: tuple[str, ...]  # the files it reads, each faulted in turn


COMMANDS = {
    "train": Command(
        ("train", "--config", "config.yaml", "--output-dir", "new-run"),
        ("new-run", "cache"),
        (
            "config.yaml",
            "data.jsonl",
            "prompts.jsonl",
            "base/config.json",
            "base/model.safetensors",
            "base/tokenizer.json",
            "base/tokenizer_config.json",
            "cache/*/meta.json",
            "cache/*/data/*.arrow",
        ),
    ),
    "resume": Command(
        ("train", "--config", "config.yaml", "--output-dir", "run", "--resume", "--max-steps", "3"),
        ("run", "cache"),
        (
            "run/checkpoint-2/adapter_model.safetensors",
            "run/checkpoint-2/trainer_state.json",
            "run/checkpoint-2/training_state_rank0.safetensors",
            "run/checkpoint-2/training_state_rank0.json",
            "run/checkpoint-2/rng_state_rank0.safetensors",
            "run/checkpoint-2/COMPLETE",
            "run/metrics.jsonl",
            "run/.lora-tune.lock",
        ),
    ),
    "merge": Command(
        ("merge", "--adapter", "run", "--base", "base", "--output", "merged", "--dtype", "fp32"),
        ("merged",),
        (
            "run/adapter_config.json",
            "run/adapter_model.safetensors",
            "run/tokenizer_config.json",
            "base/config.json",
            "base/model.safetensors",
        ),
    ),
    "export": Command(
        ("export", "run", "--base", "base", "--output", "run.gguf"),
        ("run.gguf",),
        (
            "run/adapter_config.json",
            "run/adapter_model.safetensors",
            "run/tokenizer.json",
            "base/config.json",
            "base/model.safetensors",
        ),
    ),
    "eval": Command(
        ("eval", "run", "--base", "base", "--tasks", "tiny_add", "--include", "tasks", "--limit", "2"),
        ("run/eval_results.json",),
        ("run/adapter_config.json", "run/adapter_model.safetensors", "base/config.json", "base/model.safetensors", "tasks/tiny_add.yaml"),
    ),
    "plan": Command(("plan", "--config", "config.yaml", "--gpu-memory", "24GB"), (), ("config.yaml", "base/config.json")),
    "report": Command(("report", "run"), ("run/report.png",), ("run/metrics.jsonl",)),
}
FAULTS = ("truncated", "empty", "garbage", "link", "dangling link", "folder")


def apply(fault: str, path: Path, seed: str) -> None:
    """Do `fault` to the file at `path` (inside the world; a link points inside it too, so the
    digest covers what it points at)."""
    data = path.read_bytes()
    if fault == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "empty":
        path.write_bytes(b"")
    elif fault == "garbage":
        path.write_bytes(random.Random(seed).randbytes(max(len(data), 64)))
    elif fault in ("link", "dangling link"):
        target = path.parents[len(path.parents) - 1] / "elsewhere" / seed
        if fault == "link":
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        path.unlink()
        path.symlink_to(target)
    elif fault == "folder":
        path.unlink()
        path.mkdir()


# Outcomes that are not "refused with exit 2": the fault is harmless to that command. A link to an
# intact copy reads as the file itself (but no file the run writes may be a link: refused); a damaged
# cache entry is rebuilt; a lock note is only a note (an empty or garbage one is taken over); COMPLETE
# is a marker whose content nobody reads, and without it checkpoint-2 is incomplete, so the run resumes
# from checkpoint-1; merge only copies the adapter's tokenizer_config.json; prompts and metrics lines
# that survive a cut are still prompts and records, and a torn metrics line is dropped. Everything
# else is refused, in one line.
HARMLESS = {
    ("*", "link"),
    ("train", "cache/*/meta.json"),
    ("train", "cache/*/data/*.arrow"),
    ("train", "prompts.jsonl", "truncated"),
    ("resume", "run/.lora-tune.lock", "truncated"),
    ("resume", "run/.lora-tune.lock", "empty"),
    ("resume", "run/.lora-tune.lock", "garbage"),
    ("resume", "run/checkpoint-2/COMPLETE"),
    ("resume", "run/metrics.jsonl", "truncated"),
    ("resume", "run/metrics.jsonl", "empty"),
    ("resume", "run/metrics.jsonl", "garbage"),
    ("merge", "run/tokenizer_config.json"),
    ("report", "run/metrics.jsonl", "truncated"),
}
REFUSED = {  # written by the run: a link there is refused, even to an intact copy
    ("resume", "run/metrics.jsonl", "link"),
    ("resume", "run/.lora-tune.lock", "link"),
}


def needs(command: str) -> None:
    """The optional extras a command runs with (lora-tune[eval], lora-tune[export])."""
    extra = {"eval": "lm_eval", "export": "gguf"}.get(command)
    if extra:
        pytest.importorskip(extra, reason=f"{command} needs the optional {extra}")


def expected_code(command: str, target: str, fault: str) -> int:
    keys = {("*", fault), (command, target), (command, target, fault)}
    return 0 if keys & HARMLESS and (command, target, fault) not in REFUSED else 2


CASES = [(c, t, f) for c, cmd in COMMANDS.items() for t in cmd.reads for f in FAULTS]


def in_copy(world: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "w"
    shutil.copytree(world, copy, symlinks=True)
    return copy


def resolve(root: Path, pattern: str) -> Path:
    (path,) = sorted(root.glob(pattern)) if "*" in pattern else [root / pattern]
    return path


def check(code: int, out: str, err: str, expected: int) -> None:
    assert "Traceback" not in out + err, err[-3000:]
    assert code == expected, err[-3000:]
    if code != 0:
        single_error_line(err)


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("command,target,fault", CASES, ids=[f"{c}-{t}-{f}" for c, t, f in CASES])
def test_a_faulty_file(command, target, fault, world, tmp_path, capsys, monkeypatch):
    needs(command)
    root = in_copy(world, tmp_path)
    monkeypatch.chdir(root)
    apply(fault, resolve(root, target), f"{command}-{target}-{fault}".replace("/", "_").replace("*", "x"))
    cmd = COMMANDS[command]
    before = tree_digest(root, skip=tuple(root / p for p in cmd.own))
    try:
        code = main(list(cmd.argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    check(code, out, err, expected_code(command, target, fault))
    assert tree_digest(root, skip=tuple(root / p for p in cmd.own)) == before, "a file outside the command's output changed"
    assert not leftovers(root)


# --- the Python API: the same faults raise UserError (or succeed), nothing else -----------------------
API = {
    "train": lambda: lora_tune.train("config.yaml", output_dir="new-run"),
    "resume": lambda: lora_tune.train("config.yaml", output_dir="run", resume=True, max_steps=3),
    "merge": lambda: lora_tune.merge(adapter="run", base="base", output="merged", dtype="fp32"),
    "export": lambda: lora_tune.export(source="run", base="base", output="run.gguf"),
    "eval": lambda: lora_tune.evaluate("run", base="base", tasks="tiny_add", include="tasks", limit=2),
    "plan": lambda: lora_tune.plan("config.yaml", gpu_memory="24GB"),
    "report": lambda: lora_tune.report("run"),
}
API_CASES = [(c, t, f) for c, cmd in COMMANDS.items() for t in cmd.reads for f in ("garbage", "dangling link")]


@pytest.mark.parametrize("command,target,fault", API_CASES, ids=[f"{c}-{t}-{f}" for c, t, f in API_CASES])
def test_a_faulty_file_through_the_api(command, target, fault, world, tmp_path, capsys, monkeypatch):
    needs(command)
    root = in_copy(world, tmp_path)
    monkeypatch.chdir(root)
    apply(fault, resolve(root, target), f"api-{command}-{target}-{fault}".replace("/", "_").replace("*", "x"))
    own = tuple(root / p for p in COMMANDS[command].own)
    before = tree_digest(root, skip=own)
    try:
        API[command]()
        code = 0
    except UserError as e:
        code = e.exit_code
        assert "\n" not in str(e), str(e)
    assert code == expected_code(command, target, fault)
    assert "Traceback" not in capsys.readouterr().err
    assert tree_digest(root, skip=own) == before


# --- read-only disks: the whole world, or only what the command reads ----------------------------------
OUTSIDE = {  # where each command writes when its inputs are read-only but its output is not
    "train": ("--output-dir", "new-run"),
    "merge": ("--output", "merged"),
    "export": ("--output", "run.gguf"),
    "eval": ("--output", "results.json"),
    "report": ("--output", "report.png"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("output", ["inside", "outside"])
def test_a_read_only_disk(command, output, world, tmp_path, capsys, monkeypatch):
    needs(command)
    if output == "outside" and command not in OUTSIDE:
        pytest.skip("writes nothing, or only into the read-only folder")
    with tmpfs(tmp_path / "ro", size="16m", read_only=True, fill=lambda disk: shutil.copytree(world, disk / "w", symlinks=True)) as disk:
        root = disk / "w"
        monkeypatch.chdir(root)
        argv = list(COMMANDS[command].argv)
        if output == "outside":
            flag, name = OUTSIDE[command]
            argv += [flag, str(tmp_path / name)]
        before = tree_digest(root)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        # plan writes nothing; with the output elsewhere, the read-only cache means tokenizing in memory
        check(code, out, err, 0 if command == "plan" or output == "outside" else 2)
        assert tree_digest(root) == before
        monkeypatch.chdir(tmp_path)


# --- kills during each stage (subprocesses) --------------------------------------------------------------
def until(condition, timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def big_world(world, tmp_path):
    """The world with 10,000 rows to tokenize (a few seconds: long enough to be killed in)."""
    root = in_copy(world, tmp_path)
    write_jsonl(root / "data.jsonl", [{"text": f"row {i} " + "words " * 40} for i in range(10_000)])
    return root


def run_here(root: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_tune", *argv], cwd=root, capture_output=True, text=True, timeout=600)


def launch(root: Path, argv) -> subprocess.Popen:
    command = [sys.executable, "-m", "lora_tune", *argv]
    return subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_kill_while_tokenizing_leaves_nothing_half_built(big_world):
    """SIGTERM: exit 143, one line, the unfinished build removed. SIGKILL: the unfinished build stays
    until the next build, which recognises it (its lock is free) and removes it."""
    root = big_world
    argv = list(COMMANDS["train"].argv)
    before = tree_digest(root, skip=(root / "cache", root / "new-run"))
    for how in (signal.SIGTERM, signal.SIGKILL):
        proc = launch(root, argv)
        assert until(lambda: list((root / "cache").glob(".*.tmp-*")) or proc.poll() is not None), "no build started"  # noqa: B023
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        proc.send_signal(how)
        _, err = proc.communicate(timeout=120)
        if how == signal.SIGTERM:
            assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
            assert "stopped: stopped by SIGTERM while tokenizing data.jsonl; nothing of it was cached" in err
            assert not leftovers(root)
        assert tree_digest(root, skip=(root / "cache", root / "new-run")) == before
    assert leftovers(root), "SIGKILL leaves the unfinished build"
    again = run_here(root, argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not leftovers(root) and len(list((root / "cache").glob("*/meta.json"))) == 2


def test_a_kill_while_merging_leaves_nothing_half_written(world, tmp_path):
    root = in_copy(world, tmp_path)
    argv = list(COMMANDS["merge"].argv)
    before = tree_digest(root, skip=(root / "merged",))
    for how in (signal.SIGTERM, signal.SIGKILL):
        proc = launch(root, argv)
        assert until(lambda: (root / f".merged.tmp-{proc.pid}" / "config.json").exists() or proc.poll() is not None)  # noqa: B023
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        proc.send_signal(how)
        _, err = proc.communicate(timeout=120)
        if how == signal.SIGTERM:
            assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
            assert "stopped: stopped by SIGTERM while merging into merged; nothing was written" in err
            assert not leftovers(root)
        assert not (root / "merged").exists()
        assert tree_digest(root, skip=(root / "merged", root / f".merged.tmp-{proc.pid}")) == before
    again = run_here(root, argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not leftovers(root) and (root / "merged" / "model.safetensors").is_file()


def test_a_kill_at_each_stage_of_training_then_resume_finishes(world, tmp_path):
    """SIGKILL while the model loads, mid-step and mid-checkpoint-write, each time resuming: nothing
    outside the run changes, no checkpoint looks complete that isn't, and the last resume finishes
    with every step logged once."""
    root = in_copy(world, tmp_path)
    out = root / "new-run"
    argv = [*COMMANDS["train"].argv, "--max-steps", "20", "--save-steps", "1"]
    before = tree_digest(root, skip=(out, root / "cache"))
    stages = {
        "loading": lambda: (out / ".lora-tune.lock").exists(),  # taken after the checks, before loading
        "step": lambda: metrics_lines(out) >= 4,
        "checkpoint write": lambda: list(out.glob(".checkpoint-*.tmp-*")),
    }
    for stage, reached in stages.items():
        proc = launch(root, argv if stage == "loading" else [*argv, "--resume"])
        assert until(lambda: reached() or proc.poll() is not None), stage  # noqa: B023
        assert proc.poll() is None, (stage, proc.stderr.read()[-3000:])
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        assert tree_digest(root, skip=(out, root / "cache")) == before, stage
        assert all((p / "COMPLETE").is_file() for p in out.glob("checkpoint-*")), stage
    again = run_here(root, [*argv, "--resume"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 21))
    assert not leftovers(root)
