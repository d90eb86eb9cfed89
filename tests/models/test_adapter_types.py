"""--peft-type: peft's other adapter types train through lora-tune, merge exactly (through peft's own
merge_and_unload, said in one line), load with stock peft, resume exactly, and check-serving tells
vLLM / llama.cpp users to merge first."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_tune.cli import main
from lora_tune.models.adapter_types.registry import TYPES

from helpers import ALPACA, adapter_tensors, assert_bit_identical, fast_train_args, run_cli, single_error_line, step_losses, write_jsonl

TRAINED = [name for name, kind in TYPES.items() if name != "lora" and kind.refusal is None]
RUN = dict(max_steps=3, lr=2e-2)
IDS = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Each type, the same 3 steps on the tiny model (fp32), and plain LoRA beside them."""
    root = tmp_path_factory.mktemp("types")
    data = write_jsonl(root / "alpaca.jsonl", ALPACA)
    for name in ["lora", *TRAINED]:
        assert main([str(a) for a in fast_train_args(tiny_model, data, root / name, **RUN, peft_type=name)]) == 0
    return {"root": root, "data": data}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def test_every_type_lora_tune_offers_is_trained_here_or_refused_saying_why():
    assert set(TRAINED) == {"oft", "boft", "loha", "lokr", "vera", "ia3", "miss", "hra"}
    assert [name for name, kind in TYPES.items() if kind.refusal] == ["adalora"]


def test_a_boft_run_and_its_merge_leave_the_compiler_variables_as_they_were(runs, tiny_model, tmp_path, capsys, monkeypatch):
    """peft's BOFT layers try to build a CUDA extension with $CC/$CXX set to gcc and, when that fails,
    leave them set: every later C++ build in the process or its children (Inductor under --compile,
    --nproc's ranks) would link with gcc and fail to load. lora-tune puts them back."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("CXX", "g++")
    code, _, err = run_cli(fast_train_args(tiny_model, runs["data"], tmp_path / "boft", max_steps=1, peft_type="boft"), capsys)
    assert code == 0, err
    assert "CC" not in os.environ and os.environ["CXX"] == "g++"
    code, _, err = run_cli(["merge", "--adapter", tmp_path / "boft", "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert "CC" not in os.environ and os.environ["CXX"] == "g++"


@pytest.mark.parametrize("name", TRAINED)
def test_each_type_trains_merges_exactly_and_loads_with_peft(name, runs, tiny_model, tmp_path, capsys):
    run = runs["root"] / name
    losses = step_losses(run)
    assert losses[0] == pytest.approx(step_losses(runs["root"] / "lora")[0], abs=2e-6)  # starts as the base, as LoRA does
    assert losses[-1] < losses[0]
    assert json.loads((run / "adapter_config.json").read_text())["peft_type"] == name.upper()
    code, _, err = run_cli(["merge", "--adapter", run, "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert f"a {name.upper()} adapter is not a LoRA pair per weight" in err and "peft merges it" in err
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), run)
    want = logits(peft_model)
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)), want, rtol=0, atol=5e-6
    )
    base = logits(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    assert (want - base).abs().max() > 1e-2, "the adapter must change the function, or the merge check proves nothing"
    for engine in ("vllm", "llama.cpp"):
        code, _, err = run_cli(["check-serving", run, "--engine", engine], capsys)
        assert code == 2 and f"serves LoRA adapters only, not {name.upper()}: merge first" in single_error_line(err)


@pytest.mark.parametrize("name", ["loha", "vera"])
def test_a_type_resumes_exactly(name, runs, tiny_model, tmp_path, capsys):
    """4 steps straight = 2 steps, then 2 more from the checkpoint (dropout on: the RNG resumes too)."""
    args = dict(max_steps=4, save_steps=2, lr=2e-2, peft_type=name, dropout=0.1, lr_scheduler="constant")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli(fast_train_args(tiny_model, runs["data"], straight, **args), capsys)[0] == 0
    assert run_cli(fast_train_args(tiny_model, runs["data"], resumed, **{**args, "max_steps": 2}), capsys)[0] == 0
    code, _, err = run_cli(fast_train_args(tiny_model, runs["data"], resumed, **args, resume=True), capsys)
    assert code == 0 and "resumed from" in err, err
    assert_bit_identical(adapter_tensors(straight), adapter_tensors(resumed))


@pytest.mark.parametrize("fmt,out", [("gguf", "model.gguf"), ("gguf-lora", "adapter.gguf")])
def test_export_of_another_type_says_merge_first(fmt, out, runs, tmp_path, capsys):
    code, _, err = run_cli(["export", runs["root"] / "oft", "--format", fmt, "--output", tmp_path / out], capsys)
    assert code == 2 and "holds a OFT adapter, not LoRA pairs, which this reads: merge it first" in single_error_line(err)
