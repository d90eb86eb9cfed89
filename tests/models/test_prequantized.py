"""Checkpoints that ship quantized weights (gpt-oss's MXFP4 experts): trained dequantized, merged
into plain weights, 8/4-bit refused in one line. A tiny gpt-oss is written in the release's on-disk
format (experts as `*_blocks` + `*_scales`, `quantization_config.quant_method: mxfp4`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, Mxfp4Config

from lora_tune.models.structure import text_ids
from lora_tune.models.tiny.configs import shrink_config
from lora_tune.models.tiny.model import train_tiny_tokenizer

from helpers import fast_train_args, read_metrics, run_cli, single_error_line


@pytest.fixture(scope="module")
def mxfp4_base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(shrink_config(CONFIG_MAPPING["gpt_oss"]())).to(torch.bfloat16).save_pretrained(folder)
    train_tiny_tokenizer().save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = weights.pop(key).shape  # the module's (E, in, out); MXFP4 stores (E, out, in/32, 16) + scales
        weights[f"{key}_blocks"] = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        weights[f"{key}_scales"] = torch.randint(120, 130, (experts, n_out, n_in // 32), dtype=torch.uint8, generator=g)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_mxfp4_experts_train_dequantized_and_merge_into_plain_weights(mxfp4_base, data_files, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(mxfp4_base, data_files["alpaca"], run, max_steps=2, dropout=0.0), capsys)
    assert code == 0, err
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in read_metrics(run) if "loss" in r)
    assert any("experts" in k for k in load_file(str(run / "adapter_model.safetensors")))  # LoRA on the dequantized experts
    merged = tmp_path / "merged"
    code, _, err = run_cli(["merge", "--adapter", run, "--output", merged, "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert "ships mxfp4-quantized weights" in err
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    with safe_open(str(next(merged.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(n.endswith(("_blocks", "_scales")) for n in names)
    reference = AutoModelForCausalLM.from_pretrained(mxfp4_base, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    reference = PeftModel.from_pretrained(reference, run).eval()
    ids = text_ids(reference, (2, 16), seed=0)
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids, use_cache=False).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


@pytest.mark.parametrize("precision", ["8bit", "4bit"])
def test_requantizing_a_quantized_checkpoint_is_one_line_before_loading(precision, mxfp4_base, data_files, tmp_path, capsys):
    code, _, err = run_cli(fast_train_args(mxfp4_base, data_files["alpaca"], tmp_path / "run", precision=precision), capsys)
    assert code == 2
    assert single_error_line(err).startswith(f"error: --precision {precision}: this checkpoint ships mxfp4-quantized weights")
    assert not (tmp_path / "run").exists()
