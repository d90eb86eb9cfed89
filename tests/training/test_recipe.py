"""`lora-tune train` end to end on a 2-layer Llama through the real CLI and from_pretrained: every
precision and format, pinned losses, accumulation, exact resume, evaluation, LoRA variants."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lora_tune.cli import setup_logging
from lora_tune.config import TrainConfig
from lora_tune.models.adapter import checkpointed_layers
from lora_tune.models.tiny.model import build_tiny_llama
from lora_tune.planner.architecture import load_architecture
from lora_tune.planner.memory import estimate, setup_from
from lora_tune.preflight import check_inputs
from lora_tune.training.recipe import Recipe

from helpers import FAST, adapter_tensors, fast_train_args, read_metrics, run_cli, write_jsonl


@pytest.mark.parametrize(
    "precision,fmt,optim",
    [
        ("fp32", "alpaca", "adamw_8bit"),
        ("bf16", "messages", "adamw"),
        ("fp16", "alpaca", "adamw"),
        ("8bit", "prompt_completion", "adamw_8bit"),
        ("4bit", "text", "paged_adamw_8bit"),
    ],
)
def test_each_precision_and_format_trains_a_loadable_adapter(precision, fmt, optim, tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files[fmt], out, precision=precision, optim=optim), capsys)
    assert code == 0, err
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "lora_tune_config.yaml",
        "metrics.jsonl",
        "checkpoint-4/COMPLETE",
    ):
        assert (out / name).exists(), name
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model.resolve())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]

    tensors = adapter_tensors(out)
    lora_b = {k: v for k, v in tensors.items() if "lora_B" in k}
    assert len(lora_b) == 2 * 7 and all(v.dtype == torch.float32 for v in tensors.values())
    assert all(v.abs().max() > 0 for v in lora_b.values()), "lora_B starts at zero and must have moved"

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert len(loaded) == len(lora_b)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes"} <= rows[0].keys()
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows)  # finite and positive


@pytest.mark.parametrize(
    "batching,first_loss",
    [
        (dict(packing=False, group_by_length=False), 6.2290),  # micro-batches of 2 shuffled samples, padded
        ({}, 6.2607),  # the defaults: 2 packed rows of up to 128 tokens
    ],
)
def test_loss_is_pinned_and_decreases(batching, first_loss, tiny_model, data_files, tmp_path, capsys):
    """torchtune-style: the first-step loss of this fixed tiny setup is a known number."""
    out = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], out, max_steps=12, lr=2e-2, dropout=0.0, **batching), capsys)
    assert code == 0, err
    losses = [r["loss"] for r in read_metrics(out)]
    # LoRA B starts at 0, so step 1 is the base model's loss on the first micro-batch (seed 7).
    assert losses[0] == pytest.approx(first_loss, abs=1e-3)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3


def test_grad_accumulation_matches_one_big_batch(tiny_model, data_files, tmp_path, capsys):
    """Token-weighted loss: 2 micro-batches of 2 give the same update as 1 of 4 (same samples)."""
    outs = {}
    for mbs, ga in [(4, 1), (2, 2)]:
        out = tmp_path / f"mbs{mbs}"
        # One step over all 4 samples of a 4-sample file: the same samples whatever the split.
        data = write_jsonl(tmp_path / "four.jsonl", [{"text": "a b c " * (i + 1)} for i in range(4)])
        code, _, err = run_cli(
            fast_train_args(tiny_model, data, out, micro_batch_size=mbs, grad_accum=ga, max_steps=1, dropout=0.0), capsys
        )
        assert code == 0, err
        outs[mbs] = adapter_tensors(out)
        loss = read_metrics(out)[0]["loss"]
        outs[f"loss{mbs}"] = loss
    assert outs["loss4"] == pytest.approx(outs["loss2"], rel=1e-5)
    # The step's gradients, not the updated weights, are what accumulation must reproduce: Adam's
    # first step divides each gradient by its own magnitude, so where |g| is near eps (1e-8) it
    # turns float rounding between the two summation orders into visible weight differences.
    grads = {mbs: step_gradients(tiny_model, data, tmp_path / f"grads{mbs}", mbs, ga) for mbs, ga in [(4, 1), (2, 2)]}
    scale = max(float(g.abs().max()) for g in grads[4].values())
    assert scale > 0
    for k in grads[4]:  # equal to fp32 summation-order rounding: 1e-4 relative, or a millionth of the largest
        torch.testing.assert_close(grads[2][k], grads[4][k], rtol=1e-4, atol=1e-6 * scale)


def test_cpu_passes_give_the_gradients_of_one_pass(tiny_model, tmp_path):
    """On a CPU a micro-batch of more than PASS_TOKENS padded tokens runs in passes of whole rows
    (lora_tune.data.batching.passes): the step's loss and LoRA gradients are those of one pass over
    the micro-batch, within fp32 summation-order rounding."""
    words = "the model reads a long line of text and learns the next word of it".split()
    rows = [{"text": " ".join(words[(i + k) % len(words)] for k in range(n))} for i, n in enumerate([260, 300, 330, 280])]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    cfg = TrainConfig(
        base=str(tiny_model),
        data=str(data),
        output_dir=str(tmp_path / "out"),
        precision="fp32",
        rank=4,
        max_steps=1,
        micro_batch_size=4,
        max_seq_len=512,
        optim="adamw",
        seed=7,
        dropout=0.0,
    )
    inputs = check_inputs(cfg)
    assert inputs.device.type == "cpu" and inputs.levers.pass_tokens == 1024
    results = {}
    for name, levers in [("passes", inputs.levers), ("one pass", replace(inputs.levers, pass_tokens=None))]:
        recipe = Recipe(replace(inputs, levers=levers))
        recipe.setup()
        try:
            loop = recipe.loop
            batches = loop.step_batches(0)
            divisor = loop._step_totals(batches)
            loss = sum(float(loop.engine.forward_backward(batch, divisor)) for batch in batches)
            grads = {k: p.grad.detach().clone() for k, p in loop.model.peft_model.named_parameters() if p.requires_grad}
            results[name] = (len(batches), [b.inputs["input_ids"].shape[0] for b in batches], loss, grads)
        finally:
            recipe.cleanup()
    (n_passes, pass_rows, loss, grads), (n_one, one_rows, loss_one, grads_one) = results["passes"], results["one pass"]
    assert n_one == 1 and one_rows == [4] and n_passes == 2 and pass_rows == [2, 2]
    assert loss == pytest.approx(loss_one, rel=1e-6)
    scale = max(float(g.abs().max()) for g in grads_one.values())
    for k in grads_one:
        torch.testing.assert_close(grads[k], grads_one[k], rtol=1e-4, atol=1e-6 * scale)


def step_gradients(base: Path, data: Path, out: Path, mbs: int, ga: int) -> dict[str, torch.Tensor]:
    """The LoRA gradients of the first optimizer step, through the recipe's own batches and engine."""
    cfg = TrainConfig(
        base=str(base),
        data=str(data),
        output_dir=str(out),
        precision="fp32",
        rank=4,
        lr=5e-3,
        max_steps=1,
        micro_batch_size=mbs,
        grad_accum=ga,
        max_seq_len=128,
        optim="adamw",
        seed=7,
        dropout=0.0,
    )
    recipe = Recipe(check_inputs(cfg))
    recipe.setup()
    try:
        loop = recipe.loop
        batches = loop.step_batches(0)
        n_labels = sum(b.label_tokens for b in batches)
        for batch in batches:
            loop.engine.forward_backward(batch, n_labels)
        return {name: p.grad.detach().clone() for name, p in loop.model.peft_model.named_parameters() if p.requires_grad}
    finally:
        recipe.cleanup()


@pytest.mark.parametrize("mixed", [False, True], ids=["one-source", "two-sources-mixed"])
def test_resume_after_a_checkpoint_equals_an_uninterrupted_run(mixed, tiny_model, data_files, tmp_path, capsys):
    args = dict(max_steps=6, save_steps=3, grad_accum=2, dropout=0.1, lr_scheduler="cosine", warmup_steps=2)
    data = data_files["alpaca"]
    if mixed:  # two cached sources in a weighted mix: the same samples come back in the same order
        data = [data_files["alpaca"], data_files["messages"]]
        args["data_weights"] = ["2", "1"]
    full = tmp_path / "full"
    code, _, err = run_cli(fast_train_args(tiny_model, data, full, **args), capsys)
    assert code == 0, err

    # A run that stopped right after checkpoint-3: its folder holds just what was on disk then.
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(full / "checkpoint-3", stopped / "checkpoint-3")
    shutil.copy(full / "lora_tune_config.yaml", stopped)
    (stopped / "metrics.jsonl").write_text("".join(line + "\n" for line in (full / "metrics.jsonl").read_text().splitlines()[:5]))
    code, _, err = run_cli(fast_train_args(tiny_model, data, stopped, resume=True, **args), capsys)
    assert code == 0, err

    a, b = adapter_tensors(full), adapter_tensors(stopped)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["step"] for r in read_metrics(stopped) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_metrics(stopped) if "loss" in r] == [r["loss"] for r in read_metrics(full) if "loss" in r]


def test_resume_may_extend_the_run(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], out, max_steps=2, save_steps=1, lr_scheduler="constant"), capsys)[0] == 0
    code, _, err = run_cli(
        fast_train_args(
            tiny_model, data_files["text"], out, max_steps=4, save_steps=2, logging_steps=2, lr_scheduler="constant", resume=True
        ),
        capsys,
    )
    assert code == 0, err
    assert (out / "checkpoint-4" / "COMPLETE").exists()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 4]


def test_eval_loss_and_perplexity_are_logged(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["alpaca"], out, max_steps=4, eval_split=0.25, eval_steps=2), capsys)
    assert code == 0, err
    evals = [r for r in read_metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]  # every 2 steps; the end is step 4, evaluated once
    assert f"eval at step 2: loss {evals[0]['eval_loss']:.4f}, perplexity {evals[0]['eval_ppl']:.2f}" in err  # on the console too
    assert evals[0]["eval_ppl"] == pytest.approx(2.718281828 ** evals[0]["eval_loss"], rel=1e-6)
    code, _, err = run_cli(
        fast_train_args(tiny_model, data_files["alpaca"], tmp_path / "run2", max_steps=2, eval_data=data_files["text"], eval_steps=1),
        capsys,
    )
    assert code == 0, err
    assert len([r for r in read_metrics(tmp_path / "run2") if "eval_loss" in r]) == 2


def test_target_modules_and_rslora_dora_reach_peft(tiny_model, data_files, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(
        fast_train_args(
            tiny_model, data_files["text"], out, max_steps=1, target_modules=["q_proj", "v_proj"], rslora=True, dora=True, alpha=8
        ),
        capsys,
    )
    assert code == 0, err
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["use_rslora"] is True and config["use_dora"] is True and config["lora_alpha"] == 8
    assert any("lora_magnitude_vector" in k for k in adapter_tensors(out))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="activation offload moves activations off a CUDA device")
def test_activation_offload_keeps_the_loss_and_lowers_device_memory(tiny_model, data_files, tmp_path, capsys):
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload-{offload}"
        code, _, err = run_cli(
            fast_train_args(
                tiny_model, data_files["alpaca"], out, precision="bf16", max_steps=2, max_seq_len=512, activation_offload=offload
            ),
            capsys,
        )
        assert code == 0, err
        runs[offload] = read_metrics(out)
    assert [r["loss"] for r in runs[True]] == pytest.approx([r["loss"] for r in runs[False]], rel=1e-3)
    assert runs[True][-1]["peak_memory_bytes"] <= runs[False][-1]["peak_memory_bytes"]


def test_auto_checkpointing_keeps_the_layers_the_budget_allows_and_the_same_numbers(data_files, tmp_path, capsys):
    """--gradient-checkpointing auto with a budget between the plans of one and two layers kept (of
    four): three layers recomputed, the last keeping its activations; the numbers never change."""
    base = build_tiny_llama(tmp_path / "four-layers", num_hidden_layers=4)
    options = {**FAST, "base": str(base), "data": str(data_files["alpaca"])}
    arch = load_architecture(str(base))
    setup = setup_from(TrainConfig(output_dir="o", **options))
    totals = [estimate(arch, replace(setup, kept_layers=k)).per_device["total_bytes"] for k in (1, 2)]
    assert totals[0] < totals[1]
    losses = {}
    for mode in ("on", "off"):
        code, _, err = run_cli(fast_train_args(base, data_files["alpaca"], tmp_path / mode, gradient_checkpointing=mode), capsys)
        assert code == 0, err
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode) if "loss" in r]
    cfg = TrainConfig(output_dir=str(tmp_path / "auto"), gradient_checkpointing="auto", memory_budget=sum(totals) / 2 / 2**30, **options)
    recipe = Recipe(check_inputs(cfg))
    try:
        recipe.setup()
        layers = checkpointed_layers(recipe.loop.model.peft_model)
        assert [layer.gradient_checkpointing for layer in layers] == [True, True, True, False]
        recipe.train()
        recipe.save()
    finally:
        recipe.cleanup()
    assert "gradient checkpointing (auto): 3 of 4 decoder layers recomputed, the rest keep their activations" in capsys.readouterr().err
    assert [r["loss"] for r in read_metrics(tmp_path / "auto") if "loss" in r] == losses["on"] == losses["off"]


def test_auto_checkpointing_on_a_cpu_keeps_only_the_last_layer(data_files, tmp_path, capsys):
    """No device budget on a CPU: auto recomputes every layer but the last, whose activations cost no
    more than rebuilding it would (backward reaches it first); the plan says so, and --gradient-
    checkpointing on still recomputes every layer."""
    base = build_tiny_llama(tmp_path / "four-layers", num_hidden_layers=4)
    options = {**FAST, "base": str(base), "data": str(data_files["alpaca"])}
    arch = load_architecture(str(base))
    setup = setup_from(TrainConfig(output_dir="o", **options))
    assert estimate(arch, replace(setup, kept_layers=1)).per_device["total_bytes"] <= estimate(arch, setup).per_device["total_bytes"]
    flags = {}
    setup_logging()  # the log to this test's stderr, as the CLI sets it up
    for mode in ("auto", "on"):
        recipe = Recipe(check_inputs(TrainConfig(output_dir=str(tmp_path / mode), gradient_checkpointing=mode, **options)))
        try:
            recipe.setup()
            flags[mode] = [layer.gradient_checkpointing for layer in checkpointed_layers(recipe.loop.model.peft_model)]
        finally:
            recipe.cleanup()
    assert flags == {"auto": [True, True, True, False], "on": [True, True, True, True]}
    err = capsys.readouterr().err
    assert "gradient checkpointing (auto): 3 of 4 decoder layers recomputed" in err
    assert "of checkpointing every layer: no device memory budget on cpu, --memory-budget sets one" in err
