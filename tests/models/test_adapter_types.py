"""--peft-type: peft's other adapter types train through lora-tune, merge exactly (through peft's own
merge_and_unload, said in one line), load with stock peft, resume exactly, and check-serving tells
vLLM / llama.cpp users to merge first."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import AdaLoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from lora_tune.cli import main
from lora_tune.engines import common
from lora_tune.models.adapter_types import adalora
from lora_tune.models.adapter_types.registry import TYPES
from lora_tune.preflight import adapter_cells

from helpers import ALPACA, adapter_tensors, assert_bit_identical, fast_train_args, run_cli, single_error_line, step_losses, write_jsonl

TRAINED = [name for name in TYPES if name != "lora"]
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


def test_every_type_lora_tune_offers_is_trained_here():
    assert set(TRAINED) == {"oft", "boft", "loha", "lokr", "vera", "ia3", "adalora", "miss", "hra"}


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


# --- AdaLoRA: its rank allocation and orthogonality penalty around each optimizer step -------------
def adalora_model(tiny_model, total_step: int):
    """A causal-LM AdaLoRA (task_type: peft's forward then goes through AdaLoraModel.forward, which adds the
    penalty to the loss; a bare PeftModel's doesn't)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    modules = ["q_proj", "v_proj", "down_proj"]
    return get_peft_model(base, AdaLoraConfig(init_r=4, target_r=2, total_step=total_step, target_modules=modules, task_type="CAUSAL_LM"))


def test_an_adalora_step_is_peft_own(tiny_model):
    """lora-tune's step (the data loss without the penalty, then clip_and_step with the type's hooks)
    moves every weight and masks every singular value as peft's documented loop does: its forward's
    loss (data + orth_reg_weight x penalty), backward, optimizer step, update_and_allocate, zero_grad."""
    total = 4
    peft_side, ours = adalora_model(tiny_model, total), adalora_model(tiny_model, total)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))

    def optimizer(model):
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2, weight_decay=0.01)

    peft_opt, our_opt = optimizer(peft_side), optimizer(ours)
    schedule = torch.optim.lr_scheduler.LambdaLR(our_opt, lambda step: 1.0)
    hooks = adalora.RankAllocation(ours, total)
    params = [p for p in ours.parameters() if p.requires_grad]
    for step in range(total):
        peft_side(input_ids=ids, labels=ids).loss.backward()
        peft_opt.step()
        peft_side.base_model.update_and_allocate(step)
        peft_opt.zero_grad()
        ours.base_model.model(input_ids=ids, labels=ids).loss.backward()  # the transformers model: no penalty in its loss
        common.clip_and_step(params, our_opt, schedule, None, 0.0, hooks)
    want, got = dict(peft_side.named_parameters()), dict(ours.named_parameters())
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    masked = [int((p == 0).sum()) for name, p in got.items() if "lora_E" in name]
    assert sum(masked) > 0 and masked == [int((p == 0).sum()) for name, p in want.items() if "lora_E" in name]
    # The allocated ranks stay with the hooks, not the config (which would cut the adapter at save).
    assert ours.peft_config["default"].rank_pattern is None and hooks.rank_pattern == peft_side.peft_config["default"].rank_pattern
    # What the planner counts beside the optimizer: three fp32 scores per trained element.
    scores = hooks.state_dict()
    held = sum(t.nbytes for name in ("ipt", "exp_avg_ipt", "exp_avg_unc") for t in scores[name].values())
    assert held == TYPES["adalora"].state_bytes * sum(p.numel() for p in params)


def test_adalora_resumes_exactly_and_ends_at_its_budget(runs, tiny_model, tmp_path, capsys):
    """A 4-step run on a 4-bit base and the same run resumed from its step-2 checkpoint in another folder end bit for bit
    alike (dropout on); the ranks left are the cubic schedule's budget at the last step; the adapter is
    written whole (every weight at --rank, the masked singular values zero) and loads with stock peft."""
    args = dict(max_steps=4, save_steps=2, lr=2e-2, peft_type="adalora", rank=6, dropout=0.1, precision="4bit")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli(fast_train_args(tiny_model, runs["data"], straight, **args), capsys)[0] == 0
    code, _, err = run_cli(fast_train_args(tiny_model, runs["data"], resumed, **args, resume=str(straight / "checkpoint-2")), capsys)
    assert code == 0 and "resumed from" in err, err
    tensors = adapter_tensors(straight)
    assert_bit_identical(tensors, adapter_tensors(resumed))
    config = json.loads((straight / "adapter_config.json").read_text())
    assert (config["init_r"], config["target_r"], config["total_step"], config["rank_pattern"]) == (6, 4, 4, None)
    values = [t for name, t in tensors.items() if "lora_E" in name]
    assert {tuple(t.shape) for t in values} == {(6, 1)}
    weights = len(values)
    budget = int((weights * 6 - weights * 4) * (1 - 3 / 4) ** 3 + weights * 4)  # the schedule at step index 3 of 4
    assert sum(int((t != 0).sum()) for t in values) == budget
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), straight)
    assert (logits(peft_model) - logits(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))).abs().max() > 1e-3


FOUR_BIT_ONE_DEVICE = [c for c in adapter_cells() if c.refusal is None and c.column == "4-bit, one device" and c.name]


@pytest.mark.parametrize("cell", FOUR_BIT_ONE_DEVICE, ids=[c.name for c in FOUR_BIT_ONE_DEVICE])
def test_every_accepted_four_bit_cell_trains_from_the_base_function(cell, runs, tiny_model, tmp_path, capsys):
    """The adapter table's 4-bit one-device cells (the init or type on an NF4 base): a step from the base's
    function, plain LoRA's first loss on the same base, and the adapter written."""
    args = dict(precision="4bit", max_steps=1, optim="adamw_8bit")
    losses = {}
    for name, options in (("plain", {}), (cell.name, {k: v for k, v in cell.options.items() if k != "precision"})):
        code, _, err = run_cli(fast_train_args(tiny_model, runs["data"], tmp_path / name, **args, **options), capsys)
        assert code == 0, err
        losses[name] = step_losses(tmp_path / name)[0]
    # bf16 compute through each type's own 4-bit layer path: well under one bf16 ulp of the loss (2^-8 relative).
    assert losses[cell.name] == pytest.approx(losses["plain"], rel=2e-4)
    assert adapter_tensors(tmp_path / cell.name)
