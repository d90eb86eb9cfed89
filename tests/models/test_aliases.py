"""Aliases ship their architecture, so shapes are known offline."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import constants
from transformers import AutoConfig, AutoModelForCausalLM

from lora_tune.errors import UserError
from lora_tune.models.aliases import ALIASES, architecture, resolve_base
from lora_tune.planner.architecture import Architecture

from helpers import run_cli

REQUIRED = (
    "llama-70b llama-8b llama2-7b llama2-13b llama2-70b mistral-7b qwen2.5-7b qwen2.5-72b qwen3-8b mixtral-8x7b gemma2-9b phi3-mini".split()
)
# Published parameter counts (model cards, safetensors metadata), in billions.
PUBLISHED = {
    "llama-70b": 70.55,
    "llama-8b": 8.03,
    "llama2-7b": 6.74,
    "llama2-13b": 13.02,
    "llama2-70b": 68.98,
    "mistral-7b": 7.24,
    "qwen2.5-7b": 7.62,
    "qwen2.5-72b": 72.7,
    "qwen3-8b": 8.19,
    "mixtral-8x7b": 46.70,
    "gemma2-9b": 9.24,
    "phi3-mini": 3.82,
}


# Current releases: totals as the model cards publish them (2-3 significant digits), in billions; the
# shipped configs of several are rebuilt from the published architecture, which this pins.
CURRENT = {
    "qwen3-30b-a3b": 30.5,
    "qwen3-235b-a22b": 235,
    "qwen3-next-80b-a3b": 80,
    "gemma3-27b": 27.4,
    "llama4-scout": 109,
    "gpt-oss-20b": 21,
    "gpt-oss-120b": 117,
    "glm4.5-air": 106,
    "mistral-small3.2-24b": 24,
    "deepseek-v3": 671,
}


@pytest.mark.parametrize("alias", list(CURRENT))
def test_current_releases_plan_their_published_size(alias):
    """The whole checkpoint is counted (an image-text model's vision tower too; gpt-oss's MXFP4 and
    DeepSeek's FP8 weights as the bf16 they are trained in), within the published figure's rounding."""
    assert "/" in ALIASES[alias].hub_id
    assert Architecture.from_config(architecture(alias)).total / 1e9 == pytest.approx(CURRENT[alias], rel=0.01)


def test_current_releases_plan_lora_on_the_language_model_only(capsys):
    """Gemma 3 27B: rank 16 on every linear of the 62 text layers, none on the SigLIP tower."""
    code, out, _ = run_cli(["plan", "--base", "gemma3-27b", "--rank", "16", "--json"], capsys)
    per_layer = 16 * ((5376 + 4096) + 2 * (5376 + 2048) + (4096 + 5376) + 2 * (5376 + 21504) + (21504 + 5376))
    assert code == 0 and json.loads(out)["trainable_parameters"] == 62 * per_layer == 113_516_544
    code, _, err = run_cli(["plan", "--base", "deepseek-v3", "--backend", "fsdp", "--gpus", "8", "--precision", "bf16"], capsys)
    assert code == 2 and "this checkpoint ships fp8-quantized weights" in err


@pytest.mark.parametrize("alias", REQUIRED)
def test_alias_architecture_builds_a_transformers_config(alias):
    arch = architecture(alias)
    config = AutoConfig.for_model(**arch)
    assert config.num_hidden_layers == arch["num_hidden_layers"]
    assert "/" in ALIASES[alias].hub_id
    assert Architecture.from_config(arch).total / 1e9 == pytest.approx(PUBLISHED[alias], rel=0.002)


def test_unknown_alias_suggests_close_one():
    with pytest.raises(UserError, match=r"unknown model alias 'llama2-7' \(did you mean llama2-7b\?\)"):
        resolve_base("llama2-7")


def test_missing_base_directory_is_named(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        resolve_base(str(tmp_path / "nope"))


def cached_hub_model(monkeypatch, tmp_path, repo_id: str) -> None:
    """A hub cache (offline) that holds `repo_id`, laid out the way huggingface_hub writes it."""
    snapshot = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hub_ids_and_folders_pass_through(tiny_model, tmp_path, monkeypatch):
    cached_hub_model(monkeypatch, tmp_path, "meta-llama/Llama-3.1-8B")
    assert resolve_base("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert resolve_base(str(tiny_model)) == str(tiny_model)
    assert resolve_base("llama-8b") == "meta-llama/Llama-3.1-8B"


def test_hub_ids_missing_offline_fail_at_once(tmp_path, monkeypatch):
    cached_hub_model(monkeypatch, tmp_path, "meta-llama/Llama-3.1-8B")
    with pytest.raises(
        UserError, match=r"^--base: the model Qwen/Qwen2.5-7B is not in the local Hugging Face cache and offline mode is on"
    ):
        resolve_base("Qwen/Qwen2.5-7B")
    with pytest.raises(UserError, match="^--base: the model Qwen/Qwen2.5-7B is not in the local"):
        resolve_base("qwen2.5-7b")


def test_models_command_lists_every_alias_with_its_size(capsys, tiny_model):
    code, out, _ = run_cli(["models"], capsys)
    assert code == 0
    rows = {line.split()[0]: line.split()[2] for line in out.splitlines()[1:]}
    for alias in REQUIRED:
        assert rows[alias].endswith("B") and float(rows[alias][:-1]) == pytest.approx(PUBLISHED[alias], rel=0.002)
    tiny = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(tiny_model)).parameters())
    assert rows["tiny-llama"] == f"{tiny / 1e6:.2f}M"
    # a table: every hub id starts under "hub id", every size ends under "params", long aliases too
    header, *lines = out.splitlines()
    hub_at, params_end = header.index("hub id"), header.index("params") + len("params")
    assert {line.index(line.split()[1]) for line in lines} == {hub_at}
    assert {line.index(line.split()[2]) + len(line.split()[2]) for line in lines} == {params_end}
