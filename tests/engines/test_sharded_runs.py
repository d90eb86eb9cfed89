"""The multi-process backends (DDP, DeepSpeed ZeRO-1/2/3, FSDP2) through the real CLI: 2 processes, gloo, CPU.

The distributed runs of this file go through one 2-process job (`run_jobs`), one after another: the
matrix of accepted cells and the train/resume pairs cost one start-up together. The run killed by
a rank's death needs processes of its own (below, against a reference from the job).
"""

from __future__ import annotations

import glob
import json
import math
import re
import time
from pathlib import Path

import psutil
import pytest
import torch

from lora_tune.engines.registry import Cell, supported_cells
from lora_tune.engines.state import load_safe_state
from lora_tune.planner.architecture import load_architecture
from lora_tune.planner.memory import base_weight_bytes
from lora_tune.preflight import adapter_cells

from families import build_family
from helpers import (
    ALPACA,
    LORAPLUS_RATIO,
    LORAPLUS_RUN,
    adapter_tensors,
    assert_bit_identical,
    assert_loraplus_first_step,
    fast_train_args,
    read_metrics,
    run_cli,
    run_cli_subprocess,
    run_jobs,
    single_error_line,
    start,
    step_losses,
    wait_for_steps,
    write_jsonl,
)

pytest.importorskip("deepspeed")

SHARDED_CELLS = [c for c in supported_cells() if c.backend != "single"]
CELL_IDS = [f"{c.backend}-{c.precision}-zero{c.zero}-{c.offload}" for c in SHARDED_CELLS]
# Train 4 steps with a checkpoint at step 2, then rerun from that checkpoint in a fresh folder: the
# adapter must come out bit for bit the same. dropout 0.1 so the RNG state must resume too.
RESUMED = {
    # PiSSA under ZeRO-3: each layer's partitioned weight gathered, decomposed and partitioned again.
    "zero3-bf16-offload": dict(zero=3, offload="cpu", precision="bf16", dropout=0.1, optim="adamw_8bit", init_lora_weights="pissa_niter_2"),
    "zero3-4bit-offload": dict(zero=3, offload="cpu", precision="4bit", optim="adamw_8bit", lr=5e-2),
    "zero2-8bit": dict(zero=2, precision="8bit", optim="adamw_8bit", lr=5e-2, init_lora_weights="eva"),  # EVA: each rank runs its pass
    "zero3-8bit-offload": dict(zero=3, offload="cpu", precision="8bit", dropout=0.1, optim="adamw_8bit", lr=5e-2),
    "fsdp-bf16": dict(backend="fsdp", precision="bf16", dropout=0.1, optim="adamw_8bit", lr=5e-2),
    "fsdp-4bit-offload": dict(backend="fsdp", offload="cpu", precision="4bit", optim="adamw_8bit", lr=5e-2),
    "fsdp-8bit": dict(backend="fsdp", precision="8bit", dropout=0.1, optim="adamw_8bit", lr=5e-2),
    # PiSSA decomposed layer by layer as FSDP2 streams the base in; checkpoints hold the converted adapter.
    "fsdp-pissa": dict(backend="fsdp", precision="bf16", init_lora_weights="pissa_niter_2", optim="adamw_8bit", lr=5e-2),
    "ddp-4bit": dict(backend="ddp", precision="4bit", dropout=0.1, optim="adamw_8bit", lr=5e-2),
}
RUN_ARGS = dict(max_steps=4, save_steps=2, micro_batch_size=2, grad_accum=2)
# Resumed with --allow-config-change and these: each engine's optimizer must take them from step 3 on.
CHANGED_ON_RESUME = ("zero2-8bit", "fsdp-bf16", "ddp-4bit")
CHANGES = dict(lr=2e-2, weight_decay=0.1)
# DPO over packed pairs: the reference precomputed in a collective pass (ZeRO-3) or per step (FSDP2, DDP).
PREFERENCE = {
    "zero3-dpo": dict(zero=3, reference="precompute"),
    "fsdp-dpo": dict(backend="fsdp", reference="per-step"),
    "ddp-dpo": dict(backend="ddp", reference="per-step"),
}
PREFERENCE_ARGS = dict(objective="dpo", precision="fp32", optim="adamw", max_steps=4, save_steps=2, micro_batch_size=2, grad_accum=1)
PAIRS = [
    {"prompt": f"Pick a fruit {i}:", "chosen": f" {a} is good", "rejected": f" {b} {b} is bad"}
    for i, (a, b) in enumerate([("apple", "kiwi"), ("peach", "plum"), ("pear", "lemon"), ("grape", "mango")] * 4)
]
# GRPO on 2 ranks: reference log-probabilities (beta > 0) and old ones (3 iterations per generation
# batch) scored collectively; each rank generates its share of the prompts. A checkpoint at step 2
# falls inside the first generation batch, so a resume reads every rank's share of it back.
GRPO = {
    "zero2-grpo": dict(zero=2),
    "zero3-grpo": dict(zero=3),
    "fsdp-grpo": dict(backend="fsdp"),
    "ddp-grpo": dict(backend="ddp"),
}
GRPO_ARGS = dict(
    objective="grpo", num_generations=4, micro_batch_size=4, grad_accum=2, max_new_tokens=8, max_seq_len=64, beta=0.05, num_iterations=3,
    max_steps=4, save_steps=2, lr=5e-2, lr_scheduler="constant",
)  # fmt: skip
GRPO_PROMPTS = [{"prompt": f"Write numbers {a}:", "answer": str(a)} for a in range(8)]
EVEN_REWARD = """
import os

def even(prompts, completions, completion_ids, answer, **kwargs):
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]

def fails_on_rank_1(prompts, completions, **kwargs):
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 can't score")
    return [0.0] * len(completions)
"""
HOLDS = re.compile(r"(zero-3|fsdp): rank (\d) holds ([\d,]+) of ([\d,]+) base parameters.*\(after loading\)")
HELD_BYTES = re.compile(
    r"(?:zero-3|fsdp): rank (\d) holds [\d,]+ of [\d,]+ base parameters \(([\d,]+) of ([\d,]+) bytes of base tensors\) on "
    r"\S+(?: \(CPU offload\))?, peak [\d.]+ GiB \((after loading|after step 1)\)"
)
# DeepSpeed keeps parameters under 100k elements whole on every rank (a speed trade); a tiny model's
# are all that small, so the partition measurements turn that off.
NO_PERSISTENCE = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


# --compile on 2 ranks, against fsdp-fp32-exact's eager run of the same steps.
COMPILED = {
    "fsdp-fp32-compiled": dict(backend="fsdp", compile=True),
    "zero2-fp32-compiled": dict(zero=2, compile=True),
    "ddp-fp32-compiled": dict(backend="ddp", compile=True),
}
# Two steps: the first compiles, the second trains the updated weights through the compiled layers.
# A later step of a new width recompiles, which costs 35 s (ZeRO-2) to 80 s (FSDP2) on 2 ranks with
# a cold Inductor cache (a fresh checkout): recompiling over many widths is tested on one device
# (tests/training/test_compilation.py, 20 steps).
COMPILED_ARGS = {**RUN_ARGS, "grad_accum": 1, "max_steps": 2}
MOE_ARGS = dict(precision="4bit", max_steps=1, grad_accum=1, micro_batch_size=2, optim="adamw_8bit")
# Another adapter type (LoHa) under ZeRO-2, resumed from step 2 (the RESUMED pattern; its tensors are not LoRA pairs).
TYPED = {
    "zero2-loha": dict(zero=2, peft_type="loha", dropout=0.1, optim="adamw", lr=5e-2),
    # VeRA under ZeRO-3: peft puts it on the partitioned base (its shared projections sized from the layers' features).
    "zero3-vera": dict(zero=3, peft_type="vera", dropout=0.1, optim="adamw", lr=5e-2),
}
# Another type on 2 ranks, one micro-batch each, against one process: under FSDP2 LoHa (each layer's adapter
# drawn where the streamed layer is filled, seeded by its name as on one process), VeRA (its shared
# projections drawn before the base streams in) and OFT (its index buffers rebuilt then); AdaLoRA under DDP
# (its penalty and rank allocation on every rank alike, from the all-reduced gradients).
TYPED_EXACT = {
    "fsdp-loha": dict(backend="fsdp", peft_type="loha"),
    "fsdp-vera": dict(backend="fsdp", peft_type="vera", lr=5e-2),
    "fsdp-oft": dict(backend="fsdp", peft_type="oft", lr=5e-2),
    "ddp-adalora": dict(backend="ddp", peft_type="adalora", lr=2e-2),
}
TYPE_TENSORS = {"loha": "hada_", "adalora": "lora_", "vera": "vera_", "oft": "oft_R"}
# LoRA+ on 2 ranks, one micro-batch each: FSDP2's local shards, DeepSpeed's CPU Adam on offloaded states, DDP.
LORAPLUS = {
    "fsdp-loraplus": dict(backend="fsdp"),
    "zero3-offload-loraplus": dict(zero=3, offload="cpu"),
    "ddp-loraplus": dict(backend="ddp"),  # DDP once built its optimizer without LoRA+'s groups: B moved at 1 x lr
}
# Every accepted multi-process cell of the matrix's adapter table (preflight.adapter_cells) but plain LoRA's
# (SHARDED_CELLS): one step, fp32 (4-bit where the column says), against one process's first loss.
# Those trained by another test of this file are left out: TYPED_EXACT's, TYPED's, and RESUMED's PiSSA and EVA cells.
TRAINED_ELSEWHERE = {
    ("DDP", "adalora"),
    ("FSDP2", "loha"),
    ("FSDP2", "vera"),
    ("FSDP2", "oft"),
    ("ZeRO-1/2", "loha"),
    ("ZeRO-3", "pissa"),
    ("FSDP2", "pissa"),
    ("ZeRO-1/2", "eva"),
    ("ZeRO-3", "vera"),
}
ADAPTER_CELLS = [
    c for c in adapter_cells() if c.refusal is None and "nproc" in c.options and c.name and (c.column, c.name) not in TRAINED_ELSEWHERE
]


def adapter_cell_id(cell) -> str:
    return "cell-" + re.sub(r"[^a-z0-9]+", "-", f"{cell.column}-{cell.name}".lower()).strip("-")


def adapter_cell_args(cell) -> dict:
    options = {k: v for k, v in cell.options.items() if k != "nproc"}
    return {**options, "precision": "4bit" if options.get("precision") == "4bit" else "fp32"}


EXACT = ("fsdp", "ddp")  # backends whose 2 ranks of one micro-batch each are one process to the bit
# 16 steps: the kill lands at step 5 (polled every 20 ms), 11 steps before the end.
KILL_ARGS = dict(max_steps=16, save_steps=2, dropout=0.1, grad_accum=2, micro_batch_size=2, lr=5e-3)


def cell_args(cell: Cell) -> dict:
    return dict(precision=cell.precision, offload=cell.offload, backend=cell.backend, zero=cell.zero)


adapter = adapter_tensors


@pytest.fixture(scope="module")
def jobs(tiny_model, tmp_path_factory):
    """Every batched distributed run of this file, run once in one 2-process job."""
    root = tmp_path_factory.mktemp("distributed")
    data = write_jsonl(root / "alpaca.jsonl", ALPACA)
    (root / "rewards.py").write_text(EVEN_REWARD)
    todo, names = [], []

    def add(name, argv):
        names.append(name)
        todo.append({"argv": argv, "stderr": str(root / f"{name}.err")})

    for cell, cell_id in zip(SHARDED_CELLS, CELL_IDS):
        add(
            cell_id,
            fast_train_args(
                tiny_model, data, root / cell_id, **cell_args(cell), max_steps=1, grad_accum=1, save_steps=1000, optim="adamw_8bit"
            ),
        )
    for name, kw in RESUMED.items():
        add(name, fast_train_args(tiny_model, data, root / name, **RUN_ARGS, **kw))
        names.append(None)
        todo.append({"copy": [str(root / name / "checkpoint-2"), str(root / f"{name}-resumed")], "files": ["lora_tune_config.yaml"]})
        add(f"{name}-resumed", fast_train_args(tiny_model, data, root / f"{name}-resumed", **RUN_ARGS, **kw, resume=True))
    for name in CHANGED_ON_RESUME:  # the same checkpoint, resumed with another lr and weight decay
        names.append(None)
        todo.append({"copy": [str(root / name / "checkpoint-2"), str(root / f"{name}-changed")], "files": ["lora_tune_config.yaml"]})
        changed = {**RUN_ARGS, **RESUMED[name], **CHANGES, "resume": True, "allow_config_change": True}
        add(f"{name}-changed", fast_train_args(tiny_model, data, root / f"{name}-changed", **changed))
    pairs = write_jsonl(root / "pairs.jsonl", PAIRS)
    for name, kw in PREFERENCE.items():
        add(name, fast_train_args(tiny_model, pairs, root / name, **PREFERENCE_ARGS, **kw))
        names.append(None)
        kept = ["lora_tune_config.yaml", *(["reference_logps.safetensors"] if kw["reference"] == "precompute" else [])]
        todo.append({"copy": [str(root / name / "checkpoint-2"), str(root / f"{name}-resumed")], "files": kept})
        add(f"{name}-resumed", fast_train_args(tiny_model, pairs, root / f"{name}-resumed", **PREFERENCE_ARGS, **kw, resume=True))
    zero_config = root / "no-persistence.json"
    zero_config.write_text(json.dumps(NO_PERSISTENCE))
    prompts = write_jsonl(root / "prompts.jsonl", GRPO_PROMPTS)
    failing = f"{root / 'rewards.py'}:fails_on_rank_1"
    add(
        "zero2-grpo-reward-fails",
        fast_train_args(tiny_model, prompts, root / "zero2-grpo-reward-fails", **GRPO_ARGS, zero=2, reward=failing),
    )
    for name, kw in GRPO.items():
        partitioned = {"zero_config": zero_config} if name == "zero3-grpo" else {}  # generation from partitioned weights, measured
        add(name, fast_train_args(tiny_model, prompts, root / name, **GRPO_ARGS, **kw, **partitioned, reward=f"{root / 'rewards.py'}:even"))
    names.append(None)
    todo.append({"copy": [str(root / "fsdp-grpo" / "checkpoint-2"), str(root / "fsdp-grpo-resumed")], "files": ["lora_tune_config.yaml"]})
    add("fsdp-grpo-resumed", fast_train_args(tiny_model, prompts, root / "fsdp-grpo-resumed", **GRPO_ARGS, **GRPO["fsdp-grpo"],
                                             reward=f"{root / 'rewards.py'}:even", resume=True))  # fmt: skip
    for precision in ("8bit", "4bit"):
        name = f"zero3-{precision}-partition"
        add(
            name,
            fast_train_args(
                tiny_model, data, root / name, **RUN_ARGS, zero=3, precision=precision, zero_config=zero_config, optim="adamw_8bit"
            ),
        )
    for backend in EXACT:
        exact = {**RUN_ARGS, "grad_accum": 1, "backend": backend, "dropout": 0.0, "optim": "adamw"}
        add(f"{backend}-fp32-exact", fast_train_args(tiny_model, data, root / f"{backend}-fp32-exact", **exact))
    for name, kw in TYPED_EXACT.items():
        exact = {**RUN_ARGS, "grad_accum": 1, "dropout": 0.0, "optim": "adamw"}
        add(name, fast_train_args(tiny_model, data, root / name, **exact, **kw))
    # Two micro-batches per rank: DDP all-reduces after the second alone (the first runs under no_sync).
    add(
        "ddp-fp32-accumulated",
        fast_train_args(tiny_model, data, root / "ddp-fp32-accumulated", **RUN_ARGS, backend="ddp", dropout=0.0, optim="adamw"),
    )
    add(
        "fsdp-fp32-eager",
        fast_train_args(tiny_model, data, root / "fsdp-fp32-eager", **COMPILED_ARGS, backend="fsdp", dropout=0.0, optim="adamw"),
    )
    for name, kw in COMPILED.items():
        add(name, fast_train_args(tiny_model, data, root / name, **COMPILED_ARGS, dropout=0.0, optim="adamw", **kw))
    # A checkpoint transformers converts on load (one tensor per expert on disk, fused in the model):
    # streamed layer by layer and quantized, QLoRA on the fused experts.
    mixtral = build_family("mixtral", root / "mixtral-base")
    add("fsdp-4bit-mixtral", fast_train_args(mixtral, data, root / "fsdp-4bit-mixtral", **MOE_ARGS, backend="fsdp"))
    add("zero2-eval", fast_train_args(tiny_model, data, root / "zero2-eval", **RUN_ARGS, zero=2, lr=5e-2, eval_split=0.25, eval_steps=2))
    for name, kw in TYPED.items():
        add(name, fast_train_args(tiny_model, data, root / name, **RUN_ARGS, **kw))
        names.append(None)
        todo.append({"copy": [str(root / name / "checkpoint-2"), str(root / f"{name}-resumed")], "files": ["lora_tune_config.yaml"]})
        add(f"{name}-resumed", fast_train_args(tiny_model, data, root / f"{name}-resumed", **RUN_ARGS, **kw, resume=True))
    for name, kw in LORAPLUS.items():
        add(name, fast_train_args(tiny_model, data, root / name, **LORAPLUS_RUN, **kw, grad_accum=1, loraplus_lr_ratio=LORAPLUS_RATIO))
    for cell in ADAPTER_CELLS:
        name = adapter_cell_id(cell)
        add(name, fast_train_args(tiny_model, data, root / name, **adapter_cell_args(cell), max_steps=1, grad_accum=1, optim="adamw_8bit"))
    add("fsdp-kill-reference", fast_train_args(tiny_model, data, root / "fsdp-kill-reference", **KILL_ARGS, backend="fsdp"))
    add("zero2-kill-reference", fast_train_args(tiny_model, data, root / "zero2-kill-reference", **KILL_ARGS, zero=2))
    add("ddp-kill-reference", fast_train_args(tiny_model, data, root / "ddp-kill-reference", **KILL_ARGS))  # no backend named: DDP
    results = run_jobs(todo, root)
    outcome = {}
    for name, result in zip(names, results):
        if name:
            err = "".join(p.read_text() for p in sorted(root.glob(f"{name}.err.rank*")))
            outcome[name] = (result["code"], err, root / name)
    return {"root": root, "data": data, "pairs": pairs, "prompts": prompts, "runs": outcome, "mixtral": mixtral}


def run_of(jobs, name) -> tuple[Path, str]:
    code, err, out = jobs["runs"][name]
    assert code == 0, err[-4000:]
    return out, err


ONE_DEVICE_STEP1: dict[str, float] = {}  # precision -> first-step loss of one process, same micro-batches


@pytest.mark.parametrize("cell", SHARDED_CELLS, ids=CELL_IDS)
def test_every_accepted_cell_trains_the_one_device_loss(cell, jobs, tiny_model, tmp_path, capsys):
    """Each cell of the matrix that `train` accepts runs, and two ranks compute what one process
    computes: the first step's loss (before any update) over the same 2 micro-batches."""
    precision = cell.precision
    want = one_device_step1(precision, jobs, tiny_model, tmp_path, capsys)
    out, err = run_of(jobs, CELL_IDS[SHARDED_CELLS.index(cell)])
    # fp32 agrees to float rounding; bf16 compute (bf16, 8bit, 4bit) to well under one bf16 ulp of
    # the loss (2^-8 relative): offloading changes where, not what, the matmuls compute.
    tolerance = dict(abs=1e-5) if precision == "fp32" else dict(rel=2e-4)
    assert step_losses(out)[0] == pytest.approx(want, **tolerance)
    tensors = adapter(out)
    assert len(tensors) == 28 and all(t.shape[0 if "lora_A" in k else 1] == 4 for k, t in tensors.items())
    assert f"{cell.backend} backend" in err


def one_device_step1(precision: str, jobs, tiny_model, tmp_path, capsys) -> float:
    """One process's first loss (plain LoRA, before any update) over the 2 micro-batches 2 ranks share."""
    if precision not in ONE_DEVICE_STEP1:
        one = tmp_path / "one"
        code, _, err = run_cli(
            fast_train_args(
                tiny_model, jobs["data"], one, precision=precision, micro_batch_size=2, grad_accum=2, max_steps=1, optim="adamw_8bit"
            ),
            capsys,
        )
        assert code == 0, err
        ONE_DEVICE_STEP1[precision] = step_losses(one)[0]
    return ONE_DEVICE_STEP1[precision]


@pytest.mark.parametrize("cell", ADAPTER_CELLS, ids=[adapter_cell_id(c) for c in ADAPTER_CELLS])
def test_every_accepted_adapter_cell_trains_from_the_base_function(cell, jobs, tiny_model, tmp_path, capsys):
    """Each init and adapter type the adapter table accepts on several ranks runs a step there, from
    the base's function: its first loss is one process's plain-LoRA loss over the same micro-batches
    (every init and type starts as the base), and it writes its adapter."""
    out, err = run_of(jobs, adapter_cell_id(cell))
    args = adapter_cell_args(cell)
    want = one_device_step1(args["precision"], jobs, tiny_model, tmp_path, capsys)
    tolerance = dict(abs=1e-5) if args["precision"] == "fp32" else dict(rel=2e-4)
    assert step_losses(out)[0] == pytest.approx(want, **tolerance)
    assert f"{args.get('backend') or 'deepspeed'} backend" in err
    assert adapter(out) and json.loads((out / "adapter_config.json").read_text())["peft_type"] == args.get("peft_type", "lora").upper()


def test_fsdp_qlora_on_a_converted_moe_checkpoint_equals_one_process(jobs, tmp_path, capsys):
    """Mixtral's per-expert checkpoint tensors, fused on load, streamed layer by layer into FSDP2 at
    4-bit on 2 ranks: the first step's loss is one process's over the same 2 micro-batches."""
    out, err = run_of(jobs, "fsdp-4bit-mixtral")
    assert "fsdp backend" in err and "can't be loaded layer by layer" not in err
    one = tmp_path / "one"
    code, _, err = run_cli(fast_train_args(jobs["mixtral"], jobs["data"], one, **{**MOE_ARGS, "grad_accum": 2}), capsys)
    assert code == 0, err
    assert step_losses(out)[0] == pytest.approx(step_losses(one)[0], rel=2e-4)
    assert any("experts" in k for k in adapter(out))  # QLoRA on the fused expert tensors too


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_from_a_checkpoint_is_bit_identical(name, jobs):
    expected = resumed_exactly(jobs, name)
    assert all(t.abs().max() > 0 for k, t in expected.items() if "lora_B" in k)


def resumed_exactly(jobs, name: str) -> dict:
    """The adapter of run `name`, which its resume from step 2 (`name`-resumed) reproduced bit for bit."""
    full, _ = run_of(jobs, name)
    resumed, resumed_err = run_of(jobs, f"{name}-resumed")
    assert "resumed from" in resumed_err
    expected = adapter(full)
    assert len(expected) == 28
    assert_bit_identical(expected, adapter(resumed))
    return expected


def param_groups(state) -> list[dict]:
    """Every optimizer param group in a rank's saved training state (DeepSpeed nests the base optimizer's)."""
    if isinstance(state, dict):
        found = list(state["param_groups"]) if isinstance(state.get("param_groups"), list) else []
        return found + [g for k, v in state.items() if k != "param_groups" for g in param_groups(v)]
    return [g for v in state for g in param_groups(v)] if isinstance(state, (list, tuple)) else []


@pytest.mark.parametrize("name", CHANGED_ON_RESUME)
def test_a_resume_with_a_changed_lr_and_weight_decay_applies_them_on_every_rank(name, jobs):
    """The first resumed step runs at the new learning rate of the new schedule (cosine over 4 steps,
    at step index 2: half the peak), and every rank's optimizer holds the new values."""
    out, err = run_of(jobs, f"{name}-changed")
    assert "applied from step 3: lr 0.05 -> 0.02, weight_decay 0.0 -> 0.1" in err
    steps = {r["step"]: r["lr"] for r in read_metrics(out) if "loss" in r}
    assert steps[3] == pytest.approx(CHANGES["lr"] * 0.5 * (1 + math.cos(math.pi * 2 / 4)), rel=1e-12)
    for rank in (0, 1):
        groups = param_groups(load_safe_state(out / "checkpoint-4", f"training_state_rank{rank}")["optimizer"])
        assert groups and all(g["initial_lr"] == CHANGES["lr"] and g["weight_decay"] == CHANGES["weight_decay"] for g in groups)
    unchanged, _ = run_of(jobs, f"{name}-resumed")
    assert any(not torch.equal(a, b) for a, b in zip(adapter(out).values(), adapter(unchanged).values()))


@pytest.mark.parametrize(
    "name,expected_local",
    [
        ("zero3-bf16-offload", None),
        ("zero3-4bit-offload", "half"),
        ("fsdp-bf16", "half"),
        ("fsdp-4bit-offload", "half"),
        ("fsdp-8bit", "half"),
    ],
)
def test_the_partition_is_real(name, expected_local, jobs):
    """Each rank says what it holds of the base; the two halves make the whole."""
    _, err = run_of(jobs, name)
    holds = HOLDS.findall(err)
    assert sorted(rank for _, rank, _, _ in holds) == ["0", "1"]
    for _, _, local, total in holds:
        local, total = int(local.replace(",", "")), int(total.replace(",", ""))
        if expected_local == "half":
            assert local * 2 == total
        else:  # zero.Init keeps parameters under its persistence threshold whole
            assert 0 < local < total


@pytest.mark.parametrize("name", ["zero3-8bit-partition", "zero3-4bit-partition", "fsdp-8bit", "fsdp-4bit-offload"])
def test_quantized_bases_are_really_partitioned(name, jobs, tiny_model):
    """Every tensor reachable from the base (parameters as partitioned, buffers, bitsandbytes' CB/SCB
    and quant states, each piece of memory once), after loading and after a step: each rank holds
    half of the quantized base plus at most one layer, never the whole (bitsandbytes #1249)."""
    _, err = run_of(jobs, name)
    precision = name.split("-")[1]
    held = HELD_BYTES.findall(err)
    assert sorted((rank, when) for rank, _, _, when in held) == [
        ("0", "after loading"),
        ("0", "after step 1"),
        ("1", "after loading"),
        ("1", "after step 1"),
    ]
    layer = base_weight_bytes(load_architecture(str(tiny_model)), precision)[1]
    for _, local, whole, _ in held:
        local, whole = int(local.replace(",", "")), int(whole.replace(",", ""))
        assert whole / 2 <= local <= whole / 2 + layer, (local, whole, layer)


def test_cpu_offload_under_zero_steps_with_deepspeeds_cpu_adam(jobs):
    _, err = run_of(jobs, "zero3-bf16-offload")
    assert "DeepSpeed's CPU Adam (AdamW mode) steps the offloaded states on the host (adamw_8bit can't run on offloaded states)" in err


@pytest.mark.parametrize("backend", EXACT)
def test_several_ranks_equal_one_process_bit_for_bit(backend, jobs, tiny_model, tmp_path, capsys):
    """fp32, no dropout: 2 ranks with one micro-batch each are one process with 2 accumulation
    steps, to the bit, because every rank divides by the label tokens of the whole step. (With
    more micro-batches per rank the gradients are summed in another order: equal to rounding.)"""
    out, _ = run_of(jobs, f"{backend}-fp32-exact")
    one = tmp_path / "one"
    code, _, err = run_cli(
        fast_train_args(tiny_model, jobs["data"], one, **{**RUN_ARGS, "grad_accum": 2}, dropout=0.0, optim="adamw"), capsys
    )
    assert code == 0, err
    assert step_losses(out) == step_losses(one)
    a, b = adapter(out), adapter(one)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", list(TYPED))
def test_another_adapter_type_trains_on_two_ranks_and_resumes_bit_identical(name, jobs):
    full, err = run_of(jobs, name)
    resumed, resumed_err = run_of(jobs, f"{name}-resumed")
    assert "deepspeed backend" in err and "resumed from" in resumed_err
    tensors = adapter(full)
    assert tensors and all(TYPE_TENSORS[TYPED[name]["peft_type"]] in k for k in tensors)
    assert_bit_identical(tensors, adapter(resumed))
    assert step_losses(full)[-1] < step_losses(full)[0]


@pytest.mark.parametrize("name", list(TYPED_EXACT))
def test_another_type_on_two_ranks_is_one_process_bit_for_bit(name, jobs, tiny_model, tmp_path, capsys):
    """A LoHa adapter filled layer by layer as FSDP2 streams the base in starts where one process's
    does (peft's per-layer init, seeded by the layer's name) and trains the same, to the bit; so do
    VeRA (the shared projections it multiplies by) and OFT (the rotations built through its index
    buffers); AdaLoRA's ranks under DDP allocate as one process's (every singular value masked alike)."""
    out, err = run_of(jobs, name)
    assert f"{TYPED_EXACT[name]['backend']} backend" in err
    one = tmp_path / "one"
    kw = {k: v for k, v in TYPED_EXACT[name].items() if k != "backend"}
    code, _, err = run_cli(fast_train_args(tiny_model, jobs["data"], one, **RUN_ARGS, dropout=0.0, optim="adamw", **kw), capsys)
    assert code == 0, err
    assert step_losses(out) == step_losses(one)
    tensors = adapter(out)
    assert tensors and all(TYPE_TENSORS[kw["peft_type"]] in k for k in tensors)
    assert_bit_identical(tensors, adapter(one))
    masked = [int((t == 0).sum()) for k, t in tensors.items() if "lora_E" in k]
    assert sum(masked) > 0 or kw["peft_type"] != "adalora"


@pytest.mark.parametrize("name", list(LORAPLUS))
def test_loraplus_on_two_ranks_moves_b_by_ratio_times_one_process_plain_step(name, jobs, tiny_model, tmp_path, capsys):
    """One AdamW step from B = 0 on 2 ranks with --loraplus-lr-ratio R: every B element moved R times
    what one process's plain-LoRA step over the same 2 micro-batches moved it, A not at all."""
    out, _ = run_of(jobs, name)
    one = tmp_path / "one"
    code, _, err = run_cli(fast_train_args(tiny_model, jobs["data"], one, **LORAPLUS_RUN, grad_accum=2), capsys)
    assert code == 0, err
    assert_loraplus_first_step(adapter(out), adapter(one))


def test_ddp_accumulating_on_each_rank_is_one_process(jobs, tiny_model, tmp_path, capsys):
    """Two micro-batches per rank, the first under DDP's no_sync: the gradients are all-reduced once
    per step, and 2 ranks train one process's 4 accumulated micro-batches, step by step and in the
    adapter (to fp32 summation order)."""
    out, err = run_of(jobs, "ddp-fp32-accumulated")
    assert "ddp: rank 1 holds the whole base" in err and "ddp backend" in err
    one = tmp_path / "one"
    code, _, one_err = run_cli(
        fast_train_args(tiny_model, jobs["data"], one, **{**RUN_ARGS, "grad_accum": 4}, dropout=0.0, optim="adamw"), capsys
    )
    assert code == 0, one_err
    losses = step_losses(one)
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert step_losses(out) == pytest.approx(losses, rel=1e-6)
    got, expected = adapter(out), adapter(one)
    assert got.keys() == expected.keys()
    for key in expected:
        assert float((got[key] - expected[key]).norm() / expected[key].norm()) <= 1e-5, key


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_layers_under_sharding_train_the_eager_losses(name, jobs):
    """FSDP2's hooks stay outside the compiled layers (Dynamo skips them), ZeRO-2's parameters are
    plain and DDP's hooks sit on the LoRA weights' gradients: 2 ranks compiled train what 2 ranks
    eager train, step by step."""
    out, err = run_of(jobs, name)
    eager, _ = run_of(jobs, "fsdp-fp32-eager")  # the same steps and schedule, eager
    assert "decoder layers and the loss's chunk step compiled (regional torch.compile)" in err
    # The job's runs share 2 processes: what an earlier run compiled is not compiled again here. The
    # bound is a single device's (tests/test_compilation.py): kinds of batch and pass, never batches.
    graphs = [int(n) for n in re.findall(r"over the run: compiled (\d+) graph", err)]
    assert len(graphs) == 1 and graphs[0] <= 10
    assert step_losses(out) == pytest.approx(step_losses(eager), rel=1e-5) and len(step_losses(out)) == 2


@pytest.mark.parametrize("name", list(PREFERENCE))
def test_dpo_over_packed_pairs_on_two_ranks_is_one_process_and_resumes_exactly(name, jobs, tiny_model, tmp_path, capsys):
    """Two ranks train what one process trains over the same micro-batches (losses, gradient norm,
    log-probabilities; the first step's loss is ln 2), and a resume from step 2 ends bit for bit
    where the uninterrupted run ends."""
    out, err = run_of(jobs, name)
    per_step = PREFERENCE[name]["reference"] == "per-step"
    computed = "a forward with the adapter disabled in every step" if per_step else "reference log-probabilities of 16 + 0"
    assert computed in err
    one = tmp_path / "one"
    args = {**PREFERENCE_ARGS, "grad_accum": 2, **PREFERENCE[name]}
    code, _, one_err = run_cli(
        fast_train_args(tiny_model, jobs["pairs"], one, **{k: v for k, v in args.items() if k not in ("zero", "backend")}), capsys
    )
    assert code == 0, one_err
    two_ranks, one_process = ([r for r in read_metrics(o) if "loss" in r] for o in (out, one))
    assert two_ranks[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins", "tokens_seen"):
        assert [r[key] for r in two_ranks] == pytest.approx([r[key] for r in one_process], rel=1e-5, abs=1e-6), key
    resumed_exactly(jobs, name)


GRPO_ONE_PROCESS: dict[str, list[dict]] = {}  # the one-process run all three compare with


@pytest.mark.parametrize("name", list(GRPO))
def test_grpo_on_two_ranks_is_one_process(name, jobs, tiny_model, tmp_path, capsys):
    """Each rank generates, scores and trains whole groups of its share of the prompts; rewards are
    gathered, so 2 ranks x 2 micro-batches compute what one process computes over the same 16
    completions per step (4 micro-batches): the same rewards, advantages statistics, losses, KL and
    gradient norms, step by step, through 2 generation batches of 3 iterations."""
    out, err = run_of(jobs, name)
    if not GRPO_ONE_PROCESS:
        one = tmp_path / "one"
        args = {**GRPO_ARGS, "grad_accum": 4}
        code, _, one_err = run_cli(
            fast_train_args(tiny_model, jobs["prompts"], one, **args, reward=f"{jobs['root'] / 'rewards.py'}:even"), capsys
        )
        assert code == 0, one_err
        GRPO_ONE_PROCESS["metrics"] = [r for r in read_metrics(one) if "loss" in r]
        GRPO_ONE_PROCESS["adapter"] = adapter(one)
    two_ranks = [r for r in read_metrics(out) if "loss" in r]
    one_process = GRPO_ONE_PROCESS["metrics"]
    assert [r["step"] for r in two_ranks] == [1, 2, 3, 4]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_length"):
        # The same completions, scored alike (logged at the steps that generate: 1 and 4).
        assert [r.get(key) for r in two_ranks] == [r.get(key) for r in one_process] and two_ranks[0][key] is not None, key
    # The loss sums terms of order 1 that nearly cancel (advantages are centred): fp32 rounding of
    # those terms, in another order, is ~1e-7 absolute.
    for key in ("loss", "kl", "grad_norm", "entropy"):
        assert [r[key] for r in two_ranks] == pytest.approx([r[key] for r in one_process], rel=1e-5, abs=1e-6), key
    assert any(r["loss"] != 0 for r in two_ranks) and two_ranks[-1]["kl"] > 0  # it trained: the policy moved off the reference
    # Adam moves a weight by up to lr per step whatever its gradient's size: where a gradient is
    # rounding noise (~1e-9), the order of summation moves that weight by a fraction of lr.
    for key, tensor in adapter(out).items():
        torch.testing.assert_close(tensor, GRPO_ONE_PROCESS["adapter"][key], rtol=1e-4, atol=0.01 * GRPO_ARGS["lr"])
    if name == "zero3-grpo":  # rollouts decoded from ZeRO-3's partitions leave each rank holding its partition
        held = {(int(m[1]), m[4]): (int(m[2].replace(",", "")), int(m[3].replace(",", ""))) for m in HELD_BYTES.finditer(err)}
        for rank in (0, 1):
            local, whole = held[(rank, "after step 1")]
            assert local < 0.6 * whole


def test_grpo_on_two_ranks_resumes_inside_a_generation_batch_exactly(jobs):
    """checkpoint-2 falls inside the first generation batch (3 iterations): each rank saved its share
    of it, and the resumed run ends bit for bit where the straight one ends."""
    out, _ = run_of(jobs, "fsdp-grpo")
    assert sorted(p.name for p in (out / "checkpoint-2").glob("rollout-*")) == ["rollout-rank0.safetensors", "rollout-rank1.safetensors"]
    resumed, err = run_of(jobs, "fsdp-grpo-resumed")
    assert "resumed from" in err
    assert_bit_identical(adapter(out), adapter(resumed))
    assert step_losses(resumed)[-2:] == step_losses(out)[-2:]  # steps 3 and 4, trained after the resume


def test_a_reward_function_failing_on_one_rank_stops_every_rank_with_its_line(jobs):
    code, err, out = jobs["runs"]["zero2-grpo-reward-fails"]
    assert code == 1
    for rank in (0, 1):  # each rank ends on the same line (rank 0's is what the launcher shows); none waits
        rank_err = (jobs["root"] / f"zero2-grpo-reward-fails.err.rank{rank}").read_text()
        line = single_error_line(rank_err.split("--- end ---")[-1])
        assert "fails_on_rank_1" in line and "rank 1 can't score" in line and "at step 1" in line
    assert not list(out.glob("checkpoint-*"))


@pytest.mark.parametrize(
    "name", ["zero2-8bit", "zero3-bf16-offload", "zero3-8bit-offload", "zero3-4bit-offload", "fsdp-bf16", "fsdp-4bit-offload", "fsdp-8bit"]
)
def test_sharded_adapters_merge_into_the_full_precision_base(name, jobs, tmp_path, capsys):
    out, _ = run_of(jobs, name)
    code, _, err = run_cli(["merge", "--adapter", out, "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0 and "verified: drift" in err, err


def test_zero2_evaluates_on_every_rank_and_rank0_alone_writes_metrics(jobs):
    out, _ = run_of(jobs, "zero2-eval")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]


def test_deepspeeds_shared_memory_buffers_are_not_left_in_ram(jobs):
    """DeepSpeed's CPU backend leaves a 66 MB /dev/shm buffer per rank behind after every job
    unless each rank unlinks its own once its peers have mapped it."""

    port = (jobs["root"] / "master_port").read_text()
    assert jobs["runs"]["deepspeed-bf16-zero2-none"][0] == 0
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []


KILLED = {"zero2": dict(zero=2), "fsdp": dict(backend="fsdp"), "ddp": {}}  # ddp: --nproc 2 with no backend named


@pytest.mark.parametrize("name", list(KILLED))
def test_a_rank_killed_mid_run_ends_the_job_with_one_message_and_resume_is_exact(name, jobs, tiny_model, tmp_path):
    """What the out-of-memory killer does: SIGKILL to one rank. The job must end soon (no rank
    left waiting in a collective), say which rank died and how to resume; the resumed run ends
    where an uninterrupted one does, bit for bit."""
    backend = KILLED[name]
    reference, _ = run_of(jobs, f"{name}-kill-reference")
    out = tmp_path / "killed"
    args = fast_train_args(tiny_model, jobs["data"], out, **KILL_ARGS, **backend, nproc=2)
    proc = start(args)
    wait_for_steps(proc, out, 5)
    ranks = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.pid)
    assert len(ranks) == 2
    ranks[1].kill()
    killed = time.time()
    _, err = proc.communicate(timeout=120)
    assert time.time() - killed < 60, "the job must end within a minute of a rank's death"
    assert proc.returncode == 137
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert "rank 1 was killed by SIGKILL" in lines[0] and "checkpoint-" in lines[0] and "--resume" in lines[0]
    assert not any(p.is_running() for p in ranks), "every rank must be gone"
    final = run_cli_subprocess([*args, "--resume"], timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    expected, got = adapter(reference), adapter(out)
    for k in expected:
        assert torch.equal(expected[k], got[k]), k
