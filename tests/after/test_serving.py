"""`lora-tune check-serving` and `serving.check_config` (--serve-with): each engine rule demonstrated on
an adapter that breaks it, and adapters that serve get the command to serve them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lora_tune.after.serving import check_config
from lora_tune.config import TrainConfig
from lora_tune.errors import UserError
from lora_tune.models.targets import Targets

from families import build_family
from helpers import fast_train_args, run_cli, single_error_line


def write_adapter(folder: Path, base: Path | str, **config) -> Path:
    """A PEFT adapter folder with the given adapter_config.json fields (tiny weights: the rules read
    the config and the tensor names, never the model)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "base_model_name_or_path": str(base),
        "use_dora": False,
        "use_rslora": False,
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(cfg["r"], 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, cfg["r"]),
    }
    if cfg["use_dora"]:
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


VLLM_RULES = [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="lora_only"), "LoRA bias"),
    (dict(r=1024), "largest --max-lora-rank"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(target_parameters=["mlp.experts.gate_up_proj"]), "silent no-op"),
    (dict(rank_pattern={"v_proj": 4}), "rank_pattern"),
]


@pytest.mark.parametrize("config,expected", VLLM_RULES, ids=[e for _, e in VLLM_RULES])
def test_each_vllm_rule_refuses_in_one_line_with_the_alternative(config, expected, tiny_model, tmp_path, capsys):
    adapter = write_adapter(tmp_path / "a", tiny_model, **config)
    code, _, err = run_cli(["check-serving", adapter, "--engine", "vllm"], capsys)
    assert code == 2
    line = single_error_line(err)
    assert expected in line and "merge" in line, line


def test_fused_expert_adapters_are_told_to_merge_then_serve(tiny_model, tmp_path, capsys):
    adapter = write_adapter(tmp_path / "moe", tiny_model, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    code, _, err = run_cli(["check-serving", adapter, "--engine", "vllm"], capsys)
    assert code == 2 and "merge (`lora-tune merge`), then serve the merged model" in single_error_line(err)


@pytest.mark.parametrize("rank,flag", [(8, ""), (16, ""), (32, " --max-lora-rank 32"), (300, " --max-lora-rank 320")])
def test_servable_adapter_gets_the_vllm_command_with_the_rank_it_needs(rank, flag, tiny_model, tmp_path, capsys):
    adapter = write_adapter(tmp_path / "ok", tiny_model, r=rank)
    code, out, err = run_cli(["check-serving", adapter], capsys)
    assert code == 0, err
    assert f"vllm serve {tiny_model} --enable-lora --lora-modules adapter={adapter}{flag}\n" in out


def test_a_trained_run_serves_everywhere(tiny_model, data_files, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(fast_train_args(tiny_model, data_files["text"], run, max_steps=1), capsys)[0] == 0
    for engine in ("vllm", "llama.cpp", "ollama"):
        code, out, err = run_cli(["check-serving", run, "--engine", engine], capsys)
        assert code == 0 and "this adapter serves" in out, (engine, err)
    assert f"ADAPTER {run} (Ollama imports" in out  # ollama: a llama-family adapter imports from safetensors
    # ... which Ollama's converter can only read with an integral alpha written as an integer (issue 52)
    assert '"lora_alpha": 8,' in (run / "adapter_config.json").read_text()


@pytest.mark.parametrize(
    "config,expected",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_parameters=["mlp.experts.down_proj"]), "fused expert"),
    ],
)
@pytest.mark.parametrize("engine", ["llama.cpp", "ollama"])
def test_llama_cpp_and_ollama_adapter_rules(engine, config, expected, tiny_model, tmp_path, capsys):
    adapter = write_adapter(tmp_path / "a", tiny_model, **config)
    code, _, err = run_cli(["check-serving", adapter, "--engine", engine], capsys)
    assert code == 2 and expected in single_error_line(err)


def test_llama_cpp_family_rule(tmp_path, capsys):
    neox = build_family("gpt_neox", tmp_path / "neox")
    adapter = write_adapter(tmp_path / "a", neox, target_modules=["query_key_value"])
    code, _, err = run_cli(["check-serving", adapter, "--engine", "llama.cpp"], capsys)
    assert code == 2 and "gpt_neox models have no llama.cpp LoRA export" in single_error_line(err)
    assert run_cli(["check-serving", adapter, "--engine", "vllm"], capsys)[0] == 0  # vLLM has no such family limit


def test_ollama_names_the_gguf_route_for_families_it_does_not_import(tmp_path, capsys):
    qwen = build_family("qwen2", tmp_path / "qwen2")
    code, out, _ = run_cli(["check-serving", write_adapter(tmp_path / "a", qwen), "--engine", "ollama"], capsys)
    assert code == 0 and "--format gguf-lora" in out


OLLAMA_IMPORT = [
    (dict(lora_alpha=16.0), "lora_alpha is 16.0 in adapter_config.json, and Ollama's converter reads it as an unsigned integer"),
    (dict(use_rslora=True), "it is rsLoRA (scaled alpha / sqrt(r)) and Ollama applies alpha / r"),
    (dict(alpha_pattern={"v_proj": 32}), "alpha_pattern gives some modules their own alpha"),
]


@pytest.mark.parametrize("config,reason", OLLAMA_IMPORT, ids=["float alpha", "rslora", "alpha_pattern"])
def test_ollama_adapter_import_follows_its_converter(config, reason, tiny_model, tmp_path, capsys):
    """check-serving approved Ollama's ADAPTER <folder> for adapters its converter can't read (lora_alpha
    16.0) or applies at the wrong scale (alpha / r for rsLoRA): those go as a GGUF adapter, scale folded."""
    adapter = write_adapter(tmp_path / "a", tiny_model, **config)
    code, out, err = run_cli(["check-serving", adapter, "--engine", "ollama"], capsys)
    assert code == 0, err
    assert "--format gguf-lora --output adapter.gguf (each module's scale folded in)" in out and f"not ADAPTER {adapter}: {reason}" in out
    assert f"lora-tune export {adapter} --format ollama --output DIR" in out
    code, out, _ = run_cli(["check-serving", write_adapter(tmp_path / "plain", tiny_model), "--engine", "ollama"], capsys)
    assert code == 0 and f"ADAPTER {tmp_path / 'plain'} (Ollama imports safetensors adapters for this family)" in out


def test_ollama_refuses_dora_naming_the_merged_ollama_export(tiny_model, tmp_path, capsys):
    code, _, err = run_cli(["check-serving", write_adapter(tmp_path / "a", tiny_model, use_dora=True), "--engine", "ollama"], capsys)
    assert code == 2 and "no DoRA magnitudes; export the merged model instead (`lora-tune export RUN_DIR --format ollama`)" in err


def test_serve_with_refuses_options_before_training(tiny_model):
    """The training-time hook: what the recipe calls once targets are resolved (before loading)."""

    def cfg(**kw):
        return TrainConfig(base=str(tiny_model), data=["x.jsonl"], output_dir="out", **kw)

    linears = Targets(("q_proj", "v_proj"))
    check_config(cfg(serve_with="vllm", rank=64), linears, "llama")  # servable: no error
    check_config(cfg(dora=True), linears, "llama")  # no --serve-with: nothing checked
    cases = [
        (cfg(serve_with="vllm", dora=True), linears, "llama", "drop --dora"),
        (cfg(serve_with="vllm", rank=1024), linears, "llama", "use --rank 512 or less"),
        (cfg(serve_with="vllm"), Targets(("q_proj",), ("mlp.experts.gate_up_proj",)), "mixtral", "silent"),
        (cfg(serve_with="llama.cpp"), linears, "gpt_neox", "no llama.cpp LoRA export"),
        (cfg(serve_with="ollama", dora=True), linears, "llama", "drop --dora"),
    ]
    for config, targets, model_type, expected in cases:
        with pytest.raises(UserError) as raised:
            check_config(config, targets, model_type)
        assert str(raised.value).startswith(f"--serve-with {config.serve_with}: ") and expected in str(raised.value)


def test_check_serving_bad_input(tmp_path, capsys):
    code, _, err = run_cli(["check-serving", tmp_path / "nope"], capsys)
    assert code == 2 and "does not exist" in single_error_line(err)
    code, _, err = run_cli(["check-serving", tmp_path, "--engine", "tgi"], capsys)
    assert code == 2 and "--engine" in single_error_line(err)
    code, _, err = run_cli(["check-serving", tmp_path], capsys)
    assert code == 2 and "not an adapter folder" in single_error_line(err)
