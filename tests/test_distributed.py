"""The sharding backends (DeepSpeed ZeRO-1/2/3, FSDP2) through the real CLI: 2 processes, gloo, CPU."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_tune.engines import Cell, refusal, supported_cells

from conftest import fast_train_args, run_cli, run_cli_subprocess, single_error_line

pytest.importorskip("deepspeed")

SHARDED_CELLS = [c for c in supported_cells() if c.backend != "single"]

ZERO_ARGS = dict(max_steps=4, save_steps=2, micro_batch_size=2, grad_accum=2, nproc=2)


def train(tiny_model, data, out, **kw):
    proc = run_cli_subprocess(fast_train_args(tiny_model, data, out, **{**ZERO_ARGS, **kw}), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def step_losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def resume_from_step_2(tiny_model, data, full: Path, stopped: Path, **kw) -> None:
    """Rerun from `full`'s checkpoint-2 in a fresh folder; the adapter must come out identical."""
    stopped.mkdir()
    shutil.copytree(full / "checkpoint-2", stopped / "checkpoint-2")
    shutil.copy(full / "lora_tune_config.yaml", stopped)
    proc = train(tiny_model, data, stopped, resume=True, **kw)
    assert "resumed from" in proc.stderr
    expected, resumed = load_file(str(full / "adapter_model.safetensors")), load_file(str(stopped / "adapter_model.safetensors"))
    assert expected.keys() == resumed.keys()
    for k in expected:
        assert torch.equal(expected[k], resumed[k]), k


def test_zero2_saves_a_non_empty_adapter_that_merges_to_base_plus_adapter(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "z2"
    train(tiny_model, data_files["alpaca"], out, zero=2, lr=5e-2, eval_split=0.25, eval_steps=2)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 28 and all(t.numel() > 0 for t in tensors.values())
    assert all(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]  # rank 0 alone writes metrics
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 4]  # evaluation runs on every rank
    code, _, err = run_cli(["merge", "--adapter", out, "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0 and "verified: drift" in err


def test_zero3_offload_loads_partitioned_saves_and_resumes_exactly(tiny_model, data_files, tmp_path):
    full = tmp_path / "full"
    proc = train(tiny_model, data_files["alpaca"], full, zero=3, offload="cpu", precision="bf16", dropout=0.1, optim="adamw_8bit")
    # Each rank held only its partition of the base while loading (zero.Init), never the whole.
    # Both ranks write to one stderr, so their lines may interleave: match, don't split lines.
    holds = re.findall(r"zero-3: rank (\d) holds ([\d,]+) of ([\d,]+) base parameters", proc.stderr)
    assert sorted(rank for rank, _, _ in holds) == ["0", "1"]
    for _, local, total in holds:
        assert 0 < int(local.replace(",", "")) < int(total.replace(",", ""))
    assert "DeepSpeed's CPU Adam (AdamW mode) steps the offloaded states on the host (adamw_8bit can't run on offloaded states)" in proc.stderr
    tensors = load_file(str(full / "adapter_model.safetensors"))
    config = json.loads((full / "adapter_config.json").read_text())
    assert all(t.shape[0 if "lora_A" in k else 1] == config["r"] for k, t in tensors.items())

    resume_from_step_2(tiny_model, data_files["alpaca"], full, tmp_path / "stopped", zero=3, offload="cpu", precision="bf16", dropout=0.1, optim="adamw_8bit")


ONE_DEVICE_STEP1: dict[str, float] = {}  # precision -> first-step loss of one process, same micro-batches


def cell_args(cell: Cell) -> dict:
    return dict(precision=cell.precision, offload=cell.offload, **({"backend": "fsdp"} if cell.backend == "fsdp" else {"zero": cell.zero}))


@pytest.mark.parametrize("cell", SHARDED_CELLS, ids=lambda c: f"{c.backend}-{c.precision}-zero{c.zero}-{c.offload}")
def test_every_accepted_cell_trains_the_one_device_loss(cell, tiny_model, data_files, tmp_path, capsys):
    """Each cell of the matrix that `train` accepts runs, and two ranks compute what one process
    computes: the first step's loss (before any update) over the same 2 micro-batches."""
    precision = cell.precision
    if precision not in ONE_DEVICE_STEP1:
        one = tmp_path / "one"
        code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], one, precision=precision, micro_batch_size=2, grad_accum=2, max_steps=1), capsys)
        assert code == 0, err
        ONE_DEVICE_STEP1[precision] = step_losses(one)[0]
    out = tmp_path / "zero"
    train(tiny_model, data_files["alpaca"], out, **cell_args(cell), max_steps=1, grad_accum=1, save_steps=1000, optim="adamw_8bit")
    # fp32 agrees to float rounding; bf16 compute (bf16, 8bit, 4bit) to well under one bf16 ulp of
    # the loss (2^-8 relative): offloading changes where, not what, the matmuls compute.
    tolerance = dict(abs=1e-5) if precision == "fp32" else dict(rel=2e-4)
    assert step_losses(out)[0] == pytest.approx(ONE_DEVICE_STEP1[precision], **tolerance)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 28 and all(t.shape[0 if "lora_A" in k else 1] == 4 for k, t in tensors.items())


@pytest.mark.parametrize("precision,zero,offload", [("4bit", 3, "cpu"), ("8bit", 2, "none")])
def test_quantized_bases_under_zero_partition_merge_and_resume_exactly(precision, zero, offload, tiny_model, data_files, tmp_path, capsys):
    kw = dict(precision=precision, zero=zero, offload=offload, optim="adamw_8bit", lr=5e-2)
    out = tmp_path / "zero"
    proc = train(tiny_model, data_files["alpaca"], out, **kw)
    if zero == 3:
        # NF4 stored in bf16 words (bnb_4bit_quant_storage), so ZeRO-3 really splits it.
        holds = re.findall(r"zero-3: rank (\d) holds ([\d,]+) of ([\d,]+) base parameters", proc.stderr)
        assert sorted(r for r, _, _ in holds) == ["0", "1"]
        for _, local, total in holds:
            assert int(local.replace(",", "")) * 2 == int(total.replace(",", ""))
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 28 and all(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)
    # Trained on a quantized base, merged into the full-precision one and verified against it.
    code, _, err = run_cli(["merge", "--adapter", out, "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0 and "verified: drift" in err
    resume_from_step_2(tiny_model, data_files["alpaca"], out, tmp_path / "stopped", **kw)


def test_matrix_refuses_what_it_does_not_run():
    cells = set(supported_cells())
    assert Cell("deepspeed", "8bit", 3, "none") not in cells and Cell("deepspeed", "fp16", 2, "none") not in cells
    assert not any(c.offload == "nvme" for c in cells)
    assert {Cell("deepspeed", "4bit", 3, "cpu"), Cell("deepspeed", "4bit", 2, "none"), Cell("deepspeed", "8bit", 2, "cpu"),
            Cell("deepspeed", "bf16", 3, "cpu"), Cell("deepspeed", "bf16", 1, "none")} <= cells
    assert refusal("single", "bf16", 0, "cpu") is not None


@pytest.mark.parametrize("overrides,expected", [
    (dict(offload="cpu"), "--offload needs a sharding backend"),
    (dict(zero=3, offload="nvme", nvme_path="nv"), "can't checkpoint and resume"),
    (dict(zero=3, precision="8bit"), "can't be partitioned by ZeRO-3"),
    (dict(zero=3, precision="8bit", offload="cpu"), "weight.CB"),
    (dict(zero=2, precision="fp16"), "loss scaler"),
    (dict(zero=3, zero_config="/no/such.json"), "does not exist"),
])
def test_refused_cells_of_the_compatibility_matrix(overrides, expected, tiny_model, data_files, tmp_path, capsys):
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "out", **overrides), capsys)
    assert code == 2 and expected in single_error_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json"])
def test_shipped_deepspeed_configs_are_taken_with_our_batch_numbers(name):
    from lora_tune.config import TrainConfig
    from lora_tune.engines import check_compatibility
    from lora_tune.engines.deepspeed import deepspeed_config

    path = Path(__file__).resolve().parent.parent / "configs" / "deepspeed" / name
    stage = json.loads(path.read_text())["zero_optimization"]["stage"]
    cfg = TrainConfig(base="b", data="d", output_dir="o", precision="bf16", zero=stage, zero_config=str(path), micro_batch_size=3, grad_accum=5)
    check_compatibility(cfg)
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["stage"] == stage and ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 5
    assert ds["zero_optimization"].get("reduce_bucket_size") == 500000000


def test_sigterm_stops_every_rank_at_the_same_step_with_a_checkpoint(tiny_model, data_files, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "term"
    args = fast_train_args(tiny_model, data_files["alpaca"], out, **{**ZERO_ARGS, "max_steps": 400, "save_steps": 1000, "zero": 2})
    proc = subprocess.Popen([sys.executable, "-m", "lora_tune", *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "stopped by SIGTERM after step" in err, err[-3000:]
    steps = {int(step) for step in re.findall(r"stopped by SIGTERM after step (\d+);", err)}
    assert len(steps) == 1, f"ranks stopped at different steps: {steps}"
    step = steps.pop()
    ckpt = out / f"checkpoint-{step}"
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "training_state_rank1.safetensors").is_file()


def test_the_deepspeed_launcher_runs_the_same_command(tiny_model, data_files, tmp_path):
    """`deepspeed --module lora_tune train ...` appends --local_rank=N and sets LOCAL_RANK: the
    command runs as it does under torchrun (LOCAL_SIZE tells DeepSpeed's CPU backend: 2 ranks)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ds"
    args = fast_train_args(tiny_model, data_files["alpaca"], out, zero=2, max_steps=2, micro_batch_size=2, grad_accum=2)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), "--module", "lora_tune", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "LOCAL_SIZE": "2"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "--local_rank=1" in proc.stdout + proc.stderr  # the launcher did pass its flag
    assert step_losses(out) and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["world_size"] == 2
