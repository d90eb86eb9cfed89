"""Never lose a run: real faults injected into the real CLI running in subprocesses."""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import (
    adapter_tensors,
    assert_bit_identical,
    fast_train_args,
    metrics_lines,
    run_cli,
    run_cli_subprocess,
    single_error_line,
    start,
)

KILL_ARGS = dict(max_steps=24, save_steps=2, dropout=0.1, grad_accum=2, micro_batch_size=2, lr=5e-3)


@pytest.fixture
def reference(tiny_model, data_files, tmp_path, capsys):
    """The uninterrupted run every interrupted one must reproduce bit for bit."""
    out = tmp_path / "reference"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], out, **KILL_ARGS), capsys)
    assert code == 0, err
    return adapter_tensors(out)


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
    assert_bit_identical(adapter_tensors(out), reference)
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
    assert_bit_identical(adapter_tensors(out), reference)


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mount_point)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e}); needs root")
    yield mount_point
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


@pytest.mark.parametrize(
    "victim",
    [
        "adapter_model.safetensors",
        "training_state_rank0.safetensors",
        "training_state_rank0.json",
        "rng_state_rank0.safetensors",
        "trainer_state.json",
    ],
)
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


def test_a_checkpoint_holds_no_pickle_and_a_planted_one_is_never_executed(tiny_model, data_files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2), capsys)[0] == 0
    assert {p.suffix for p in (out / "checkpoint-2").iterdir()} == {".safetensors", ".json", ""}  # "" : the COMPLETE marker
    marker = tmp_path / "pwned"
    monkeypatch.setenv("LORA_TUNE_PWNED", str(marker))
    torch.save({"optimizer": _Exploit()}, out / "checkpoint-2" / "training_state_rank0.safetensors")  # a pickle where state belongs
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=3, resume=True), capsys)
    assert code == 2 and "training_state_rank0" in single_error_line(err) and "unreadable" in err
    assert not marker.exists(), "the pickle payload ran"


def test_pickle_bin_weights_need_explicit_permission(tiny_model, data_files, tmp_path, capsys):
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
