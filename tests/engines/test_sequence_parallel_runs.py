"""--sequence-parallel through the real CLI: 2 gloo ranks sharing every packed row, against one process.

A tiny Llama with one key/value head (fewer than the 2 ranks: each rank gets its query heads' copy)
trains 3 steps on packed rows of several documents. The ranks of a sequence-parallel group train one
share of the micro-batches together, so `--nproc 2 --sequence-parallel 2` sees the micro-batches one
process sees: the losses per step and the adapter must agree to fp32 rounding. The same runs are
repeated on two torchrun "nodes" of one rank each over loopback (the README's multi-node command),
with and without sequence parallelism, against the single-node runs.
"""

from __future__ import annotations

import pytest

from lora_tune.models.tiny.model import build_tiny_llama

from helpers import (
    ALPACA,
    adapter_tensors,
    assert_bit_identical,
    fast_train_args,
    read_metrics,
    run_cli,
    run_jobs,
    step_losses,
    write_jsonl,
)

pytest.importorskip("deepspeed")

# Longer answers than ALPACA's: rows of 128 tokens hold 2-4 documents, and micro-batches differ in width.
DOCUMENTS = [
    {**row, "output": row["output"] + " " + " ".join(f"step {j}: {i * j}." for j in range(i % 5 + 1))} for i, row in enumerate(ALPACA * 2)
]
ARGS = dict(max_steps=3, save_steps=2, micro_batch_size=2, grad_accum=2, dropout=0.0, gradient_checkpointing="on", lr=2e-2)
RUNS = {
    "zero2-sp": dict(zero=2),
    "zero3-sp-offload": dict(zero=3, offload="cpu"),
    "fsdp-sp-eager-unpacked": dict(backend="fsdp", attn_implementation="eager", packing=False),
    "ddp-sp": dict(backend="ddp"),
}
# QLoRA (bf16 compute on a 4-bit base): the first step's loss, before any update, against one process.
QLORA = dict(precision="4bit", optim="adamw_8bit", max_steps=1, micro_batch_size=2, grad_accum=2, save_steps=1000)
# What each run is compared with in one process: the same options without a backend.
ONE_PROCESS = {name: {k: v for k, v in kw.items() if k in ("attn_implementation", "packing")} for name, kw in RUNS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence-parallel")
    base = build_tiny_llama(root / "base", num_key_value_heads=1)
    data = write_jsonl(root / "documents.jsonl", DOCUMENTS)
    todo, names = [], []

    def add(name, argv):
        names.append(name)
        todo.append({"argv": argv, "stderr": str(root / f"{name}.err")})

    for name, kw in RUNS.items():
        add(name, fast_train_args(base, data, root / name, **ARGS, **kw, sequence_parallel=2))
    # Two key/value heads for 2 ranks: each rank takes one, with its two query heads (no repeat).
    two_kv_heads = build_tiny_llama(root / "base-2kv", num_key_value_heads=2)
    add("fsdp-sp-4bit", fast_train_args(two_kv_heads, data, root / "fsdp-sp-4bit", **QLORA, backend="fsdp", sequence_parallel=2))
    names.append(None)
    todo.append({"copy": [str(root / "zero2-sp" / "checkpoint-2"), str(root / "zero2-sp-resumed")], "files": ["lora_tune_config.yaml"]})
    add("zero2-sp-resumed", fast_train_args(base, data, root / "zero2-sp-resumed", **ARGS, zero=2, sequence_parallel=2, resume=True))
    add("zero2-dp", fast_train_args(base, data, root / "zero2-dp", **ARGS, zero=2))
    results = run_jobs(todo, root)
    # The README's multi-node command over loopback: two nodes of one rank each.
    nodes = root / "nodes"
    nodes.mkdir()
    two_nodes = [
        {"argv": fast_train_args(base, data, nodes / name, **ARGS, zero=2, **extra), "stderr": str(nodes / f"{name}.err")}
        for name, extra in (("zero2-sp", dict(sequence_parallel=2)), ("zero2-dp", {}))
    ]
    node_results = run_jobs(two_nodes, nodes, nproc=1, nodes=2)
    outcome = {name: (r["code"], root / name) for name, r in zip(names, results) if name}
    outcome.update({f"nodes-{name}": (r["code"], nodes / name) for name, r in zip(("zero2-sp", "zero2-dp"), node_results)})
    return {"root": root, "base": base, "two_kv_heads": two_kv_heads, "data": data, "runs": outcome}


def run_of(runs, name):
    code, out = runs["runs"][name]
    err = "".join(p.read_text() for p in sorted(out.parent.glob(f"{out.name}.err.rank*")))
    assert code == 0, err[-4000:]
    return out, err


ONE: dict[str, object] = {}


def one_process(runs, name, capsys, tmp_path):
    """The one-process run of `name`'s options (cached per option set)."""
    key = repr(sorted(ONE_PROCESS[name].items()))
    if key not in ONE:
        out = tmp_path / "one"
        code, _, err = run_cli(fast_train_args(runs["base"], runs["data"], out, **ARGS, **ONE_PROCESS[name]), capsys)
        assert code == 0, err
        ONE[key] = (read_metrics(out), adapter_tensors(out))
    return ONE[key]


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_sharing_every_row_are_one_process(name, runs, capsys, tmp_path):
    out, err = run_of(runs, name)
    assert "attention: ulysses_" in err
    metrics, expected = one_process(runs, name, capsys, tmp_path)
    losses = [r["loss"] for r in metrics if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trained
    assert step_losses(out) == pytest.approx(losses, rel=1e-5)
    # Each rank counts the real tokens of its slices: together, the micro-batches' tokens once.
    assert [r["tokens_seen"] for r in read_metrics(out) if "loss" in r] == [r["tokens_seen"] for r in metrics if "loss" in r]
    got = adapter_tensors(out)
    assert got.keys() == expected.keys()
    # Relative to each tensor's size: Adam moves a weight by up to lr whatever its gradient's size,
    # so where a gradient is fp32 rounding noise (summed in another order here) single elements
    # differ by ~1e-4 of lr; the tensors agree to 1e-5 of their norm.
    for key in expected:
        assert float((got[key] - expected[key]).norm() / expected[key].norm()) <= 1e-5, key


def test_a_sequence_parallel_run_resumes_bit_for_bit(runs):
    out, _ = run_of(runs, "zero2-sp")
    resumed, err = run_of(runs, "zero2-sp-resumed")
    assert "resumed from" in err
    assert_bit_identical(adapter_tensors(out), adapter_tensors(resumed))
    assert step_losses(resumed)[-1:] == step_losses(out)[-1:]


@pytest.mark.parametrize("name", ["zero2-sp", "zero2-dp"])
def test_two_nodes_over_loopback_are_one_node(name, runs):
    """One torchrun per node (--nnodes 2 --node-rank N): the same ranks, the same micro-batches and
    slices, so the losses and adapter of `--nproc 2` on one node. To fp32 rounding, not bit for bit:
    within a node DeepSpeed all-reduces through shared memory, across nodes through gloo, and they
    sum in different orders."""
    one_node, _ = run_of(runs, name)
    two_nodes, err = run_of(runs, f"nodes-{name}")
    assert "rank 1" in err and "deepspeed backend" in err
    assert step_losses(two_nodes) == pytest.approx(step_losses(one_node), rel=1e-6)
    a, b = adapter_tensors(one_node), adapter_tensors(two_nodes)
    assert a.keys() == b.keys()
    for key in a:
        assert float((a[key] - b[key]).norm() / a[key].norm()) <= 1e-6, key


def test_a_4bit_base_split_across_ranks_trains_the_one_process_loss(runs, capsys, tmp_path):
    """QLoRA under FSDP2 with the key/value heads split between the ranks, not repeated."""
    out, err = run_of(runs, "fsdp-sp-4bit")
    assert "attention: ulysses_" in err and "fsdp backend" in err
    one = tmp_path / "one"
    code, _, one_err = run_cli(fast_train_args(runs["two_kv_heads"], runs["data"], one, **QLORA), capsys)
    assert code == 0, one_err
    # bf16 compute: within a fraction of one bf16 ulp of the loss (2^-8 relative)
    assert step_losses(out)[0] == pytest.approx(step_losses(one)[0], rel=2e-4)
