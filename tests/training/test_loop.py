"""The loop's exits: a NaN streak stops the run after logging and skipping its steps, an
out-of-memory step saves, prints the plan and what to change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from lora_tune.data.batching import permutation
from lora_tune.engines.single import SingleDeviceEngine

from helpers import adapter_tensors, fast_train_args, run_cli, write_jsonl


def poisoned_model(tiny_model: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the tiny model whose embedding row for '@' is inf: any sample containing '@'
    produces a NaN loss, the others train normally."""
    out = tmp_path / "poisoned"
    shutil.copytree(tiny_model, out)
    token = AutoTokenizer.from_pretrained(out)("@", add_special_tokens=False)["input_ids"]
    assert len(token) == 1
    weights = load_file(str(out / "model.safetensors"))
    weights["model.embed_tokens.weight"][token[0]] = float("inf")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, "@"


def test_nan_steps_are_logged_skipped_and_stop_the_run(tiny_model, tmp_path, capsys):
    base, poison = poisoned_model(tiny_model, tmp_path)
    n = 8
    order = permutation(n, seed=7, epoch=0)  # unpacked, micro-batch size 1: step k trains sample order[k-1]
    bad_samples = set(order[2:6])  # steps 3, 4, 5, 6 are poisoned
    rows = [{"text": f"sample {i} {poison if i in bad_samples else 'fine'}"} for i in range(n)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "run"
    code, _, err = run_cli(
        fast_train_args(
            base, data, out, max_steps=8, micro_batch_size=1, save_steps=1, max_bad_steps=3, packing=False, group_by_length=False
        ),
        capsys,
    )
    assert code == 3, err
    assert "NaN/inf for 3 steps in a row" in err and "checkpoint-2" in err
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics[2:5]] == ["nan", "nan", "nan"], "NaN steps must be logged, not filtered"
    assert [m["skipped"] for m in metrics[:5]] == [False, False, True, True, True]
    complete = sorted(p.name for p in out.glob("checkpoint-*") if (p / "COMPLETE").exists())
    assert complete == ["checkpoint-1", "checkpoint-2"], "no checkpoint is written during a bad streak"
    assert all(torch.isfinite(t).all() for t in adapter_tensors(out / "checkpoint-2").values())


def test_out_of_memory_saves_prints_the_plan_and_advice(tiny_model, data_files, tmp_path, capsys, monkeypatch):
    real = SingleDeviceEngine.forward_backward
    calls = {"n": 0}

    def sometimes_oom(self, batch, n):
        calls["n"] += 1
        if calls["n"] == 3:  # the third step
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, batch, n)

    monkeypatch.setattr(SingleDeviceEngine, "forward_backward", sometimes_oom)
    out = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=5), capsys)
    assert code == 1
    assert "out of memory at step 3" in err and "--grad-accum" in err and "expandable_segments" in err and "weights" in err
    assert (out / "checkpoint-2" / "COMPLETE").is_file()
    monkeypatch.setattr(SingleDeviceEngine, "forward_backward", real)
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=5, resume=True), capsys)
    assert code == 0 and "resumed from" in err
