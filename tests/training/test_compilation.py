"""`--compile`: regional compilation trains the same numbers as eager, compiles a bounded number of
graphs whatever the batch widths, reuses PyTorch's on-disk cache on a second run, and is refused in
one line where it can't run."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from lora_tune.models.tiny.model import build_tiny_llama
from lora_tune.training import compilation
from lora_tune.training.compilation import compile_layers, decoder_layers

from helpers import ALPACA, fast_train_args, read_metrics, run_cli, write_jsonl

STEPS = 20


def compile_lines(err: str) -> dict[str, tuple[int, float, int, int]]:
    """The log's compile reports: 'step 1' and 'over the run' -> (graphs, seconds, cache hits, misses)."""
    found = {}
    pattern = r"(step 1|over the run): compiled (\d+) graph\(s\) in ([\d.]+) s \(Inductor cache: (\d+) hit\(s\), (\d+) miss\(es\)\)"
    for when, graphs, seconds, hits, misses in re.findall(pattern, err):
        found[when] = (int(graphs), float(seconds), int(hits), int(misses))
    return found


@pytest.fixture(scope="module")
def eager_and_compiled(tiny_model, tmp_path_factory):
    """The same 20 steps of packed micro-batches (2 rows each, widths varying) run eagerly, compiled,
    then compiled again (the second run of the same setup)."""
    tmp = tmp_path_factory.mktemp("compile")
    data = write_jsonl(tmp / "alpaca.jsonl", ALPACA)
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"]), ("again", ["--compile"])):
        out = tmp / name
        argv = fast_train_args(tiny_model, data, out, max_steps=STEPS, dropout=0.0) + extra
        runs[name] = (out, argv)
    return runs


def test_compiled_losses_equal_eager_over_20_steps_with_bounded_graphs_and_a_cache_hit_on_rerun(eager_and_compiled, capsys):
    results = {}
    for name, (out, argv) in eager_and_compiled.items():
        if name != "eager":  # as a new process starts: nothing compiled in memory (the disk caches kept)
            torch._dynamo.reset()
        code, _, err = run_cli(argv, capsys)
        assert code == 0, err
        results[name] = (read_metrics(out), err)
    eager, _ = results["eager"]
    compiled, err = results["compiled"]
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    for e, c in zip(eager, compiled, strict=True):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-4), (e["step"], e["loss"], c["loss"])
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-3)
    assert eager[-1]["loss"] < eager[0]["loss"] - 0.5  # it trained: the comparison is over a moving curve

    # The micro-batches differ (packed rows of 12 samples, 2 rows each), yet the graphs stay bounded:
    # the layers' region at most 2 (one row / several) x 2 (attention mask / none) x 2 (checkpointed /
    # kept: on a CPU auto keeps the last layer's activations), the loss chunk at most 2 (one position
    # / several): never one per batch.
    step_tokens = {b - a for a, b in zip([0] + [r["tokens_seen"] for r in compiled], [r["tokens_seen"] for r in compiled], strict=False)}
    assert len(step_tokens) >= 4
    reports = compile_lines(err)
    first_graphs, first_seconds, _, _ = reports["step 1"]
    run_graphs, run_seconds, _, _ = reports["over the run"]
    assert first_graphs == 3 and first_seconds > 0  # the checkpointed layer, the kept one, the loss chunk
    assert first_graphs <= run_graphs <= 10 < STEPS
    assert "decoder layers and the loss's chunk step compiled (regional torch.compile)" in err

    # A second run of the same setup finds every graph in PyTorch's on-disk cache.
    _, again_err = results["again"]
    graphs, seconds, hits, misses = compile_lines(again_err)["over the run"]
    assert graphs == run_graphs and hits >= 1 and misses == 0
    assert seconds < run_seconds or run_seconds < 5  # the first run may itself have hit a warm cache


def test_evaluation_and_sample_generations_under_compile_match_eager(tiny_model, data_files, tmp_path, capsys):
    """Evaluation runs the compiled layers without gradients; sample generations run them eagerly
    (a KV cache would recompile them at every decoded token). Both give eager's numbers."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"instruction": "Add 2 and 3."}\n{"instruction": "Name a colour."}\n')
    records = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        argv = fast_train_args(tiny_model, data_files["alpaca"], out, eval_split=0.25, eval_steps=2, eval_prompts=prompts)
        code, _, err = run_cli([*argv, "--eval-max-new-tokens", "6", *extra], capsys)
        assert code == 0, err
        assert "recompile" not in err.lower() and "Traceback" not in err
        records[name] = [r for r in read_metrics(out) if "eval_loss" in r or "samples" in r]
    eager, compiled = records["eager"], records["compiled"]
    assert [sorted(r) for r in compiled] == [sorted(r) for r in eager] and len(eager) >= 4
    for e, c in zip(eager, compiled, strict=True):
        if "eval_loss" in e:
            assert c["eval_loss"] == pytest.approx(e["eval_loss"], rel=1e-4)
        if "samples" in e:
            assert [x["completion"] for x in c["samples"]] == [x["completion"] for x in e["samples"]]


def test_one_graph_serves_every_layer(tmp_path):
    """Regional: the layers share code and Dynamo lifts their weights to inputs, so a 3-layer model
    compiles one graph for all three (with LoRA inside each)."""
    base = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "m", num_hidden_layers=3))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.enable_input_require_grads()  # as training sets it up: every layer's input requires grad
    assert compile_layers(model.get_base_model()) == 3 == len(decoder_layers(model.get_base_model()))
    torch._dynamo.reset()  # nothing compiled in this process yet (earlier tests compiled the same layer code)
    stats = compilation.CompileStats()
    before = counters["stats"]["calls_captured"]
    ids = torch.randint(3, 100, (2, 24))
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # no KV cache in training, as the loss runs it
    assert stats.since_start()["graphs"] == 1
    assert counters["stats"]["calls_captured"] > before  # the layers did run compiled


def test_decoder_layers_are_the_outermost_module_list(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "m"))
    assert decoder_layers(model) == list(model.model.layers)


@pytest.mark.parametrize(
    "precision,compiles,expected",
    [
        ("4bit", True, "bitsandbytes' 4bit layers don't compile"),
        ("8bit", True, "bitsandbytes' 8bit layers don't compile"),
        ("bf16", False, "ZeRO-3 gathers its sharded weights from hooks inside the layers"),
        ("bf16", True, None),
    ],
)
def test_refusals_from_the_configuration(precision, compiles, expected):
    reason = compilation.refusal(precision, compiles, "ZeRO-3")
    assert reason == expected if expected is None else expected in reason


def test_the_compiler_inductor_would_call_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert "needs a C++ compiler on a CPU and $CXX (no-such-compiler-xyz) was not found" in compilation.toolchain_refusal(
        torch.device("cpu")
    )
    monkeypatch.delenv("CXX")
    assert compilation.toolchain_refusal(torch.device("cpu")) is None  # this machine has g++
    # A machine with only `c++` on PATH: Inductor calls g++ (its default), so that is what is checked.
    (tmp_path / "c++").symlink_to(shutil.which("c++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "g++ (Inductor's default; set $CXX to another) was not found" in compilation.toolchain_refusal(torch.device("cpu"))
    assert "verified on CPU and CUDA only" in compilation.toolchain_refusal(torch.device("mps"))


def test_the_run_raises_the_recompile_limit_and_restores_it():
    """All decoder layers share one code object whose graphs vary by kind of pass: past Dynamo's
    default limit (8) the layers would silently run eagerly, so a compiled run raises it, and only
    for the run."""
    default = torch._dynamo.config.recompile_limit
    with compilation.settings(True):
        assert torch._dynamo.config.recompile_limit == compilation.RECOMPILE_LIMIT > default
        assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    assert torch._dynamo.config.recompile_limit == default
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    with compilation.settings(False):
        assert torch._dynamo.config.recompile_limit == default
