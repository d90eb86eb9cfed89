"""The ways a multi-process run is started and stopped: SIGTERM reaches every rank, and the `deepspeed`
launcher runs the same command (the `--nproc` launcher's handling of a dead rank is tested against
a reference run in tests/engines/test_sharded_runs.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import psutil
import pytest
import torch

from lora_tune.training import checkpoint as ckpt
from lora_tune.training import launcher

from helpers import fast_train_args, start, step_losses, wait_for_steps

pytest.importorskip("deepspeed")

RUN_ARGS = dict(max_steps=4, save_steps=2, micro_batch_size=2, grad_accum=2)


@pytest.mark.parametrize("backend", [dict(zero=2), dict(backend="fsdp")], ids=["zero2", "fsdp"])
def test_sigterm_stops_every_rank_at_the_same_step_with_a_checkpoint(backend, tiny_model, data_files, tmp_path):
    out = tmp_path / "term"
    proc = start(
        fast_train_args(tiny_model, data_files["alpaca"], out, **{**RUN_ARGS, "max_steps": 400, "save_steps": 1000, "nproc": 2}, **backend)
    )
    wait_for_steps(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    steps = {int(step) for step in re.findall(r"stopped by SIGTERM after step (\d+);", err)}
    assert len(steps) == 1, f"ranks stopped at different steps: {steps}"
    ckpt = out / f"checkpoint-{steps.pop()}"
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "training_state_rank1.safetensors").is_file()


def test_the_deepspeed_launcher_runs_the_same_command(tiny_model, data_files, tmp_path):
    """`deepspeed --module lora_tune train ...` appends --local_rank=N and sets LOCAL_RANK: the
    command runs as it does under torchrun (LOCAL_SIZE tells DeepSpeed's CPU backend: 2 ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ds"
    args = fast_train_args(tiny_model, data_files["alpaca"], out, zero=2, max_steps=2, micro_batch_size=2, grad_accum=2)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        "--module",
        "lora_tune",
        *map(str, args),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "LOCAL_SIZE": "2"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "--local_rank=1" in proc.stdout + proc.stderr  # the launcher did pass its flag
    assert step_losses(out) and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["world_size"] == 2


def test_ranks_checkpoint_and_stop_when_the_launcher_is_killed(tiny_model, data_files, tmp_path):
    """SIGKILL the --nproc launcher (its lock and watchdog go with it): the ranks get the parent-death
    signal, finish the step, write one complete checkpoint together and exit, instead of training on."""
    out = tmp_path / "orphans"
    args = {**RUN_ARGS, "max_steps": 100_000, "save_steps": 100_000, "nproc": 2, "backend": "fsdp"}
    proc = start(fast_train_args(tiny_model, data_files["alpaca"], out, **args))
    ranks = []
    try:
        wait_for_steps(proc, out, 3)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2, ranks
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, "the ranks must stop when their launcher dies"
    finally:
        for rank in ranks:
            if rank.is_running():
                rank.kill()
    checkpoints = [p for p in out.glob("checkpoint-*") if (p / "COMPLETE").is_file()]
    assert len(checkpoints) == 1 and (checkpoints[0] / "training_state_rank1.safetensors").is_file()
    assert not (out / "adapter_model.safetensors").exists(), "stopped, not finished"
    assert ckpt.lock_holder(out) is None


def test_a_lost_peer_is_told_from_a_bug_only_within_a_process_group(tmp_path):
    assert launcher.lost_peer(RuntimeError("Connection closed by peer")) is False  # no process group: no peers to lose
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert launcher.lost_peer(RuntimeError("Connection reset by peer")) is True
        assert launcher.lost_peer(ValueError("a bug")) is False
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "failed,expected",
    [
        ([(0, 250), (1, -9)], (1, -9)),  # seen at one poll: the killed rank, not the survivor's unrecognised exit
        ([(0, launcher.LOST_PEER_EXIT), (1, 1)], (1, 1)),  # a rank that lost its peers is never the cause
        ([(0, launcher.LOST_PEER_EXIT), (1, -9)], (1, -9)),
        ([(0, 3), (1, 250)], (0, 3)),  # two exits with codes: the first rank's
    ],
)
def test_the_cause_of_a_failed_job_is_the_rank_that_died(failed, expected):
    assert launcher.cause(failed) == expected


class ExitingRank:
    """A rank the watcher polls: running for `polls` polls, then ended with `code` (None: runs until killed)."""

    def __init__(self, code, polls):
        self.code, self.polls, self.killed = code, polls, False

    def poll(self):
        if self.killed:
            return -signal.SIGKILL
        self.polls -= 1
        return self.code if self.code is not None and self.polls < 0 else None

    def wait(self):
        return self.poll()

    def kill(self):
        self.killed = True


def test_a_survivor_exiting_before_the_killed_rank_is_reaped_is_not_named_the_cause():
    """The out-of-memory killer's SIGKILL to rank 1 can take longer to reap than rank 0 takes to
    exit of the lost collective (250 under ZeRO-2): rank 1 is still the cause."""
    ranks = [ExitingRank(250, polls=3), ExitingRank(-signal.SIGKILL, polls=12)]
    failures, codes = launcher.watch(ranks, poll_s=0.001)
    assert failures == {0: 250, 1: -signal.SIGKILL} and codes == [250, -signal.SIGKILL]
    assert launcher.cause(list(failures.items())) == (1, -signal.SIGKILL)


def test_ranks_still_running_after_the_grace_seconds_are_killed_and_not_counted(monkeypatch):
    monkeypatch.setattr(launcher, "GRACE_S", 0.05)
    ranks = [ExitingRank(1, polls=2), ExitingRank(None, polls=0)]
    failures, codes = launcher.watch(ranks, poll_s=0.001)
    assert ranks[1].killed and failures == {0: 1} and codes == [1, -signal.SIGKILL]


def test_ranks_that_all_exit_with_a_code_at_once_said_why_themselves():
    """Each rank refused the same input (its own `error:` line, exit 2) before the watcher saw either: no
    cause for the launcher to name; a rank killed meanwhile is one."""
    assert launcher.watch([ExitingRank(2, polls=0), ExitingRank(2, polls=0)], poll_s=0.001) == ({}, [2, 2])
    assert launcher.watch([ExitingRank(2, polls=0), ExitingRank(-9, polls=0)], poll_s=0.001) == ({1: -9}, [2, -9])


def test_the_jobs_line_names_a_killed_rank_and_the_checkpoint_and_leaves_a_refusal_to_the_rank(tmp_path):
    """A rank that refused its input (exit 2) printed its own `error:` line, which names the input and
    the fix: the launcher adds none (it would say resume, which can't help). Any other end is one line."""
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "COMPLETE").write_text("")
    assert launcher.failure_line(0, 2, str(tmp_path), "lora-tune train ... --resume") is None
    line = launcher.failure_line(1, -signal.SIGKILL, str(tmp_path), "lora-tune train ... --resume")
    assert line == (
        "error: rank 1 was killed by SIGKILL (the out-of-memory killer sends this); the other ranks were stopped. "
        f"the last complete checkpoint is {tmp_path / 'checkpoint-4'}. Continue with: lora-tune train ... --resume"
    )
    assert launcher.failure_line(0, 1, str(tmp_path / "none"), "c").startswith("error: rank 0 exited with code 1; ")
