"""`lora-tune merge`: merged == base + adapter, streaming over shards, atomic output, clear errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from safetensors.torch import load_file as load
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_tune.after.merge.reading import lora_modules
from lora_tune.after.merge.verifying import unmerged_forward
from lora_tune.cli import main
from lora_tune.models.tiny.model import build_tiny_llama, build_tiny_model

from helpers import TEXT, fast_train_args, run_cli, single_error_line, tree_digest, write_jsonl


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """One adapter per flavour, trained through the CLI on the tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    data = write_jsonl(root / "text.jsonl", TEXT)
    flavours = {
        "fp32": {},
        "8bit": {"precision": "8bit"},
        "4bit": {"precision": "4bit"},
        "rslora": {"rslora": True},
        "dora": {"dora": True},
    }
    for name, kw in flavours.items():
        # A high learning rate so the adapter moves far from identity and a wrong merge shows.
        assert main([str(a) for a in fast_train_args(tiny_model, data, root / name, max_steps=3, lr=5e-2, **kw)]) == 0
    return {name: root / name for name in flavours}


def reference_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def merged_logits(merged: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("flavour", ["fp32", "8bit", "4bit", "rslora", "dora"])
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 5e-2)])
def test_merged_logits_equal_base_plus_adapter(flavour, dtype, tol, adapters, tiny_model, tmp_path, capsys):
    out = tmp_path / "merged"
    code, _, err = run_cli(["merge", "--adapter", adapters[flavour], "--output", out, "--dtype", dtype], capsys)
    assert code == 0, err
    assert "verified: drift" in err
    want = reference_logits(tiny_model, adapters[flavour], IDS)
    got = merged_logits(out, IDS)
    base_only = merged_logits(tiny_model, IDS)
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < tol
    assert (base_only - want).abs().max() / scale > 10 * tol or dtype == "bf16", (
        "the adapter must change the function, or the test proves nothing"
    )
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype] and "quantization_config" not in config


def test_fp32_merge_is_bit_identical_to_peft_merge_and_unload(adapters, tiny_model, tmp_path, capsys):
    out = tmp_path / "merged"
    assert run_cli(["merge", "--adapter", adapters["fp32"], "--output", out, "--dtype", "fp32"], capsys)[0] == 0
    usual = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), adapters["fp32"]
    ).merge_and_unload()
    ours = load_file(str(out / "model.safetensors"))
    theirs = usual.state_dict()
    assert set(ours) == set(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_merged_folder_is_plain_transformers_with_tokenizer_and_template(adapters, tiny_model, tmp_path, capsys):
    out = tmp_path / "merged"
    assert run_cli(["merge", "--adapter", adapters["4bit"], "--output", out], capsys)[0] == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    modules = {type(m).__module__ for m in model.modules()}
    assert not any(m.startswith(("peft", "bitsandbytes")) for m in modules), modules
    assert next(model.parameters()).dtype == torch.bfloat16
    original, merged = AutoTokenizer.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert merged.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)
    assert (merged.eos_token, merged.bos_token, merged.pad_token) == (original.eos_token, original.bos_token, original.pad_token)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == original.eos_token_id


@pytest.fixture(scope="module")
def sharded_base(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(out, max_shard_size="150KB")
    for f in tiny_model.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation")):
            shutil.copy(f, out / f.name)
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    return out


def test_merge_streams_a_sharded_base_into_shards_with_index(adapters, sharded_base, tmp_path, capsys):
    out = tmp_path / "merged"
    code, _, err = run_cli(
        ["merge", "--adapter", adapters["fp32"], "--base", sharded_base, "--output", out, "--dtype", "fp32", "--max-shard-size", "200KB"],
        capsys,
    )
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all((out / f).is_file() for f in files)
    assert all((out / f).stat().st_size <= 200_000 + 70_000 for f in files)  # one tensor may overflow a shard
    assert err.count("merging model-") == len(list(sharded_base.glob("model-*.safetensors")))
    want = reference_logits(sharded_base, adapters["fp32"], IDS)
    assert torch.allclose(merged_logits(out, IDS), want, atol=1e-5, rtol=1e-5)


def test_failure_mid_merge_leaves_no_complete_looking_output(adapters, sharded_base, tmp_path, capsys):
    broken = tmp_path / "broken-base"
    shutil.copytree(sharded_base, broken)
    last = sorted(broken.glob("model-*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-64:] = b"\xff" * 64  # NaN bit patterns in the last tensor of the last shard
    last.write_bytes(bytes(data))
    out = tmp_path / "merged"
    code, _, err = run_cli(["merge", "--adapter", adapters["fp32"], "--base", broken, "--output", out], capsys)
    assert code == 2
    assert "contains NaN/inf" in single_error_line(err)
    assert "merging model-00001" in err, "the failure must come mid-merge, after earlier shards were written"
    assert not out.exists()
    assert not list(tmp_path.glob(".merged*")), "the temporary folder must be removed"


def test_overwrite_replaces_only_when_asked(adapters, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, _, err = run_cli(["merge", "--adapter", adapters["fp32"], "--output", out], capsys)
    assert code == 2 and "--overwrite" in single_error_line(err)
    assert (out / "keep.txt").read_text() == "user data"
    # --overwrite replaces only a folder merge itself wrote: never the user's own (issue 52).
    code, _, err = run_cli(["merge", "--adapter", adapters["fp32"], "--output", out, "--overwrite"], capsys)
    assert code == 2 and "lora-tune did not write it" in single_error_line(err)
    assert (out / "keep.txt").read_text() == "user data"
    (out / "keep.txt").unlink()
    assert run_cli(["merge", "--adapter", adapters["fp32"], "--output", out], capsys)[0] == 0
    (out / "model.safetensors").write_bytes(b"stale")
    code, _, err = run_cli(["merge", "--adapter", adapters["fp32"], "--output", out, "--overwrite"], capsys)
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() != b"stale" and (out / "model.safetensors").stat().st_size > 1000


def test_modules_to_save_and_rank_pattern_follow_peft(tiny_model, tmp_path, capsys):
    """An adapter written by peft itself, with options our trainer doesn't produce."""
    torch.manual_seed(0)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"v_proj": 32},
        modules_to_save=["lm_head"],
        init_lora_weights=False,
    )
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), cfg)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    adapter = tmp_path / "peft-adapter"
    model.save_pretrained(adapter)
    out = tmp_path / "merged"
    code, _, err = run_cli(["merge", "--adapter", adapter, "--base", tiny_model, "--output", out, "--dtype", "fp32"], capsys)
    assert code == 0, err
    usual = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), adapter).merge_and_unload().state_dict()
    ours = load_file(str(out / "model.safetensors"))
    for k in ours:
        torch.testing.assert_close(ours[k], usual[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_an_adapter_on_fused_experts_merges_shard_by_shard_into_the_per_expert_layout(model_type, tmp_path, capsys):
    """Mixtral / Qwen3-MoE checkpoints store one tensor per expert, which transformers fuses on load
    and the adapter adapts fused (peft's target_parameters): the merge converts each adapted group
    to the fused layout, merges it, and converts it back (no whole model in memory); the output is
    what peft's merge_and_unload() + save_pretrained() writes, shard by shard."""
    base = build_tiny_model(model_type, tmp_path / "base")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(**{**cfg.to_dict(), "init_lora_weights": False}))
    model.save_pretrained(tmp_path / "adapter")
    code, _, err = run_cli(
        [
            "merge",
            "--adapter",
            tmp_path / "adapter",
            "--base",
            base,
            "--output",
            tmp_path / "merged",
            "--dtype",
            "fp32",
            "--max-shard-size",
            "100KB",
        ],
        capsys,
    )
    assert code == 0, err
    assert "whole model" not in err and "verified: drift" in err
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").merge_and_unload().save_pretrained(
        tmp_path / "usual"
    )
    usual = load_file(str(tmp_path / "usual" / "model.safetensors"))
    ours = {k: v for f in sorted((tmp_path / "merged").glob("model-*.safetensors")) for k, v in load_file(str(f)).items()}
    assert ours.keys() == usual.keys() and any(".experts.0." in k for k in ours)  # per-expert names, as on disk
    for k in ours:
        torch.testing.assert_close(ours[k], usual[k], rtol=0, atol=1e-6, msg=k)


def test_merge_errors(adapters, tiny_model, tmp_path, capsys):
    cases = []
    cases.append((["--adapter", tmp_path / "nope", "--output", tmp_path / "o1"], "does not exist"))
    (tmp_path / "not-adapter").mkdir()
    cases.append((["--adapter", tmp_path / "not-adapter", "--output", tmp_path / "o2"], "is not an adapter folder"))
    cases.append((["--adapter", adapters["fp32"], "--base", tmp_path / "no-base", "--output", tmp_path / "o3"], "no-base does not exist"))
    other = build_tiny_llama(tmp_path / "other-shape", hidden_size=32, intermediate_size=64)
    cases.append((["--adapter", adapters["fp32"], "--base", other, "--output", tmp_path / "o4"], "trained on another base"))
    cases.append((["--adapter", adapters["fp32"], "--output", tmp_path / "o5", "--max-shard-size", "lots"], "not a size"))
    cases.append((["--adapter", adapters["fp32"], "--output", tmp_path / "o6", "--dtype", "int4"], "--dtype"))
    for argv, expected in cases:
        code, _, err = run_cli(["merge", *argv], capsys)
        assert code == 2, (argv, err)
        assert expected in single_error_line(err), (argv, err)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))


@pytest.mark.parametrize("flavour", ["fp32", "rslora", "dora"])
def test_layer_verification_reference_equals_peft_layer(flavour, adapters, tiny_model):
    """The merge verifies against its own unmerged forward; that reference must be peft's."""

    config = json.loads((adapters[flavour] / "adapter_config.json").read_text())
    modules, _ = lora_modules(config, load(str(adapters[flavour] / "adapter_model.safetensors")))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), adapters[flavour]).eval()
    base = load(str(tiny_model / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    layer = model.get_submodule("base_model.model." + name.removesuffix(".weight"))
    x = torch.randn(3, base[name].shape[1])
    with torch.no_grad():
        torch.testing.assert_close(unmerged_forward(x, base[name], modules[name], False), layer(x), rtol=1e-5, atol=1e-6)


@pytest.fixture
def inputs(adapters, tiny_model, tmp_path):
    """A copy of an adapter and of its base, in a folder of the test's own (a wrong merge may destroy them)."""
    root = tmp_path / "models"
    shutil.copytree(tiny_model, root / "base")
    shutil.copytree(adapters["fp32"], root / "adapter", ignore=shutil.ignore_patterns("checkpoint-*"))
    return root


@pytest.mark.parametrize(
    "where",
    ["the adapter folder", "inside the adapter folder", "around the adapter folder", "the base folder", "inside the base", "around it"],
)
def test_merge_output_in_or_around_its_inputs_is_refused_even_with_overwrite(where, inputs, capsys):
    adapter, base = inputs / "adapter", inputs / "base"
    out = {
        "the adapter folder": adapter,
        "inside the adapter folder": adapter / "merged",
        "around the adapter folder": inputs,
        "the base folder": base,
        "inside the base": base / "merged",
        "around it": inputs,
    }[where]
    if "base" in where or where == "around it":  # the adapter elsewhere, so that only the base is in the way
        shutil.move(adapter, inputs.parent / "adapter")
        adapter = inputs.parent / "adapter"
    before = tree_digest(inputs.parent)
    code, _, err = run_cli(["merge", "--adapter", adapter, "--base", base, "--output", out, "--overwrite", "--dtype", "fp32"], capsys)
    assert code == 2, err
    assert "merge never writes there, --overwrite or not" in single_error_line(err)
    assert tree_digest(inputs.parent) == before


ODD_CONFIGS = {
    "r 0": ({"r": 0}, "has r = 0; the rank must be a positive integer"),
    "r true": ({"r": True}, "has r = True"),
    "no lora_alpha": ({"lora_alpha": None}, "has no lora_alpha"),
    "text lora_alpha": ({"lora_alpha": "16"}, "has lora_alpha = '16'; it must be a number"),
    "rank_pattern of text": ({"rank_pattern": {"q_proj": "eight"}}, "has rank_pattern['q_proj'] = 'eight'"),
    "rank_pattern of zero": ({"rank_pattern": {"q_proj": 0}}, "a rank must be a positive integer"),
    "rank_pattern a list": ({"rank_pattern": [8]}, "has rank_pattern = [8]; it must map module names to numbers"),
    "alpha_pattern of text": ({"alpha_pattern": {"v_proj": "x"}}, "has alpha_pattern['v_proj'] = 'x'"),
    "rslora as text": ({"use_rslora": "yes"}, "has use_rslora = 'yes'"),
    "a JSON list": ([1, 2], "holds a JSON list, not an object"),
    "binary": (b"\xff\xfe\x00garbage", "is unreadable or truncated"),
}


@pytest.mark.parametrize("odd", list(ODD_CONFIGS))
def test_an_odd_adapter_config_is_one_line(odd, inputs, tmp_path, capsys):
    change, expected = ODD_CONFIGS[odd]
    path = inputs / "adapter" / "adapter_config.json"
    if isinstance(change, bytes):
        path.write_bytes(change)
    elif isinstance(change, list):
        path.write_text(json.dumps(change))
    else:
        config = {**json.loads(path.read_text()), **change}
        path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    code, _, err = run_cli(["merge", "--adapter", inputs / "adapter", "--base", inputs / "base", "--output", tmp_path / "m"], capsys)
    assert code == 2 and expected in single_error_line(err)
    assert not (tmp_path / "m").exists()


def test_merge_output_under_a_file_or_a_bare_shard_size_is_one_line(inputs, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    adapter = ["merge", "--adapter", inputs / "adapter", "--base", inputs / "base"]
    code, _, err = run_cli([*adapter, "--output", tmp_path / "a-file" / "merged"], capsys)
    assert code == 2 and "which is a file; give a folder" in single_error_line(err)
    code, _, err = run_cli([*adapter, "--output", tmp_path / "m", "--max-shard-size", "5"], capsys)
    assert code == 2 and "--max-shard-size: '5' has no unit; write e.g. 5GB" in single_error_line(err)


def test_a_merge_killed_outright_leaves_a_folder_the_next_merge_removes(inputs, tmp_path, capsys):
    dead = tmp_path / ".m.tmp-999999"  # no such process
    (dead / "half").mkdir(parents=True)
    live = tmp_path / f".m.tmp-{os.getpid()}x"  # not a merge's name: left alone
    live.mkdir()
    code, _, err = run_cli(["merge", "--adapter", inputs / "adapter", "--base", inputs / "base", "--output", tmp_path / "m"], capsys)
    assert code == 0, err
    assert not dead.exists() and live.exists() and (tmp_path / "m" / "model.safetensors").is_file()


def interrupted(run: Path, into: Path) -> Path:
    """The folder a run leaves when it is stopped (Ctrl-C, a signal) after its last checkpoint: the
    checkpoints, its config and metrics, but no final adapter and no tokenizer (written at the end)."""
    final = ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    shutil.copytree(run, into, ignore=lambda folder, names: [n for n in names if n in final] if Path(folder) == run else [])
    assert (into / "checkpoint-3" / "COMPLETE").is_file() and not (into / "adapter_config.json").exists()
    return into


def test_an_interrupted_run_is_merged_checked_and_exported_from_its_latest_checkpoint(adapters, tmp_path, capsys):
    """merge --adapter RUN, check-serving RUN and export RUN said 'not an adapter folder' about a run's
    own folder after Ctrl-C (issue 52): they take its newest complete checkpoint, saying so."""
    run = interrupted(adapters["fp32"], tmp_path / "stopped")
    code, _, err = run_cli(["merge", "--adapter", run, "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert f"using its latest complete checkpoint, {run / 'checkpoint-3'}" in err
    # checkpoint-3 is the finished run's last step: the same adapter, so the same merged weights
    assert run_cli(["merge", "--adapter", adapters["fp32"], "--output", tmp_path / "finished", "--dtype", "fp32"], capsys)[0] == 0
    assert_equal = torch.testing.assert_close
    for name, tensor in load(tmp_path / "finished" / "model.safetensors").items():
        assert_equal(load(tmp_path / "merged" / "model.safetensors")[name], tensor, rtol=0, atol=0)
    code, out, err = run_cli(["check-serving", run, "--engine", "vllm"], capsys)
    assert code == 0 and f"adapter={run / 'checkpoint-3'}" in out, err
    code, _, err = run_cli(["export", run, "--output", tmp_path / "stopped.gguf", "--no-verify"], capsys)
    assert code == 0 and (tmp_path / "stopped.gguf").read_bytes()[:4] == b"GGUF", err


def test_a_run_stopped_before_its_first_checkpoint_is_refused_naming_resume(adapters, tmp_path, capsys):
    run = tmp_path / "early"
    run.mkdir()
    shutil.copy2(adapters["fp32"] / "lora_tune_config.yaml", run)
    code, _, err = run_cli(["merge", "--adapter", run, "--output", tmp_path / "merged"], capsys)
    assert code == 2 and "stopped before its first checkpoint" in single_error_line(err) and "--resume" in err
    assert not (tmp_path / "merged").exists()
