"""Never lose a run: real faults injected into the real CLI running in subprocesses."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import fast_train_args, run_cli, run_cli_subprocess, single_error_line, write_jsonl

KILL_ARGS = dict(max_steps=24, save_steps=2, dropout=0.1, grad_accum=2, micro_batch_size=2, lr=5e-3)


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def reference(tiny_model, data_files, tmp_path, capsys):
    """The uninterrupted run every interrupted one must reproduce bit for bit."""
    out = tmp_path / "reference"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], out, **KILL_ARGS), capsys)
    assert code == 0, err
    return adapter(out)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lora_tune", *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def metrics_lines(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_sigkill_at_random_moments_then_resume_is_bit_identical(tiny_model, data_files, tmp_path, reference):
    kills = int(os.environ.get("LORA_TUNE_KILLS", "4"))
    rng = random.Random(20261202)
    out = tmp_path / "killed"
    killed_at = []
    for _ in range(kills):
        proc = start(fast_train_args(tiny_model, data_files["alpaca"], out, resume=out.exists(), **KILL_ARGS))
        seen = metrics_lines(out)
        deadline = time.time() + 120
        while metrics_lines(out) <= seen and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)  # wait until this process is really training
        time.sleep(rng.uniform(0.0, 0.6))  # then kill anywhere: mid-step, mid-save, mid-rename
        if proc.poll() is not None:
            break  # finished before we could kill it
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at.append(metrics_lines(out))
    print(f"SIGKILLed {len(killed_at)} times, after {killed_at} metric lines")
    assert len(killed_at) >= 2, f"the run finished before being killed: {killed_at}"
    final = run_cli_subprocess(fast_train_args(tiny_model, data_files["alpaca"], out, resume=True, **KILL_ARGS))
    assert final.returncode == 0, final.stderr[-2000:]
    assert_bit_identical(adapter(out), reference)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 25)), "metrics must list each step once, in order, after resumes"
    assert not list(out.glob(".checkpoint-*")), "temporary checkpoint folders must be cleaned up or ignored"


def test_sigterm_saves_and_resume_finishes_identically(tiny_model, data_files, tmp_path, reference):
    out = tmp_path / "term"
    proc = start(fast_train_args(tiny_model, data_files["alpaca"], out, **KILL_ARGS))
    deadline = time.time() + 120
    while metrics_lines(out) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err and "--resume" in err
    step = int(err.split("after step ")[1].split(";")[0])
    assert step < KILL_ARGS["max_steps"]
    assert (out / f"checkpoint-{step}" / "COMPLETE").is_file(), "the signal handler must checkpoint the step it stopped at"
    final = run_cli_subprocess(fast_train_args(tiny_model, data_files["alpaca"], out, resume=True, **KILL_ARGS))
    assert final.returncode == 0, final.stderr[-2000:]
    assert_bit_identical(adapter(out), reference)


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mount_point)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e}); needs root")
    yield mount_point
    import gc

    gc.collect()  # drop any file handle a failed run's objects still hold
    subprocess.run(["umount", str(mount_point)], check=False, capture_output=True)
    subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)


def test_full_disk_during_save_keeps_the_previous_checkpoint(tiny_model, data_files, small_disk, capsys):
    out = small_disk / "run"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=20, save_steps=1, rank=8), capsys)
    assert code == 1, err
    line = single_error_line(err)
    assert "No space left on device" in line and "is intact" in line and "--resume" in line
    good = sorted((p for p in out.glob("checkpoint-*") if (p / "COMPLETE").exists()), key=lambda p: int(p.name.split("-")[1]))
    assert good, "the first checkpoints fit on the disk"
    assert not list(out.glob(".checkpoint-*")), "the failed temp folder must be removed"
    assert all((p / "COMPLETE").exists() for p in out.glob("checkpoint-*")), "no partial folder may look like a checkpoint"
    # The intact checkpoint is really usable: resume from it on a bigger disk.
    bigger = small_disk.parent / "moved"
    shutil.copytree(out, bigger)
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], bigger, max_steps=20, save_steps=1, rank=8, resume=True), capsys)
    assert code == 0, err
    assert f"resumed from {bigger / good[-1].name}" in err


def poisoned_model(tiny_model: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the tiny model whose embedding row for '@' is inf: any sample containing '@'
    produces a NaN loss, the others train normally."""
    from transformers import AutoTokenizer

    out = tmp_path / "poisoned"
    shutil.copytree(tiny_model, out)
    token = AutoTokenizer.from_pretrained(out)("@", add_special_tokens=False)["input_ids"]
    assert len(token) == 1
    weights = load_file(str(out / "model.safetensors"))
    weights["model.embed_tokens.weight"][token[0]] = float("inf")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, "@"


def test_nan_steps_are_logged_skipped_and_stop_the_run(tiny_model, tmp_path, capsys):
    from lora_tune.batching import permutation

    base, poison = poisoned_model(tiny_model, tmp_path)
    n = 8
    order = permutation(n, seed=7, epoch=0)  # unpacked, micro-batch size 1: step k trains sample order[k-1]
    bad_samples = set(order[2:6])  # steps 3, 4, 5, 6 are poisoned
    rows = [{"text": f"sample {i} {poison if i in bad_samples else 'fine'}"} for i in range(n)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(base, data, out, max_steps=8, micro_batch_size=1, save_steps=1, max_bad_steps=3, packing=False, group_by_length=False), capsys)
    assert code == 3, err
    assert "NaN/inf for 3 steps in a row" in err and "checkpoint-2" in err
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics[2:5]] == ["nan", "nan", "nan"], "NaN steps must be logged, not filtered"
    assert [m["skipped"] for m in metrics[:5]] == [False, False, True, True, True]
    complete = sorted(p.name for p in out.glob("checkpoint-*") if (p / "COMPLETE").exists())
    assert complete == ["checkpoint-1", "checkpoint-2"], "no checkpoint is written during a bad streak"
    assert all(torch.isfinite(t).all() for t in adapter(out / "checkpoint-2").values())


@pytest.mark.parametrize("victim", ["adapter_model.safetensors", "training_state.pt", "rng_state.safetensors", "trainer_state.json"])
def test_truncated_checkpoint_file_is_rejected_by_name(victim, tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2), capsys)[0] == 0
    path = out / "checkpoint-2" / victim
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True), capsys)
    assert code == 2
    assert str(path) in single_error_line(err)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['LORA_TUNE_PWNED']}",))


def test_malicious_pickle_in_a_checkpoint_is_not_executed(tiny_model, data_files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2), capsys)[0] == 0
    marker = tmp_path / "pwned"
    monkeypatch.setenv("LORA_TUNE_PWNED", str(marker))
    torch.save({"optimizer": _Exploit()}, out / "checkpoint-2" / "training_state.pt")
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True), capsys)
    assert code == 2 and "unsafe to load" in single_error_line(err)
    assert not marker.exists(), "the pickle payload ran"


def test_pickle_bin_weights_need_explicit_permission(tiny_model, data_files, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    bin_model = tmp_path / "bin-model"
    shutil.copytree(tiny_model, bin_model)
    (bin_model / "model.safetensors").unlink()
    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    torch.save(state, bin_model / "pytorch_model.bin")
    code, _, err = run_cli(fast_train_args(bin_model, data_files["text"], tmp_path / "run", max_steps=1), capsys)
    assert code == 2 and "--allow-bin" in single_error_line(err)


def test_trust_remote_code_is_off_unless_asked_and_warns(tiny_model, data_files, tmp_path, capsys):
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "a", max_steps=1), capsys)
    assert code == 0 and "trust_remote_code is on" not in err
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "b", max_steps=1, trust_remote_code=True), capsys)
    assert code == 0 and "trust_remote_code is on" in err


def test_a_second_run_on_the_same_output_dir_is_refused_and_a_dead_runs_lock_is_taken_over(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    args = dict(max_steps=400, save_steps=2)
    first = start(fast_train_args(tiny_model, data_files["alpaca"], out, **args))
    deadline = time.time() + 120
    while metrics_lines(out) < 3 and first.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert first.poll() is None, "the first run must still be training"
    # Even with --resume (which would otherwise continue from the first run's checkpoints).
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], out, resume=True, **args), capsys)
    assert code == 2
    line = single_error_line(err)
    assert "is being written by another lora-tune run" in line and f"pid {first.pid}" in line
    first.send_signal(signal.SIGKILL)
    first.wait()
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], out, resume=True, max_steps=6, save_steps=2), capsys)
    assert code == 0, err
    assert f"left by a run that is no longer running (pid {first.pid}" in err and "resumed from" in err
    assert (out / ".lora-tune.lock").read_text() == "", "a clean end leaves no holder behind"
