"""Every common family, right in train, plan and merge: tiny random models of Llama, Qwen2, Qwen3,
Mistral, Mixtral (fused MoE experts), Gemma-2, Phi-3 (fused projections), GPT-NeoX and GPT-2
(Conv1D), built with transformers' own config classes (tests/families.py)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from families import EXPECTED_TARGETS, FAMILIES, NO_SYSTEM_ROLE, build_family
from helpers import ALPACA, CHAT, fast_train_args, run_cli, single_error_line, write_jsonl


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def alpaca(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("famdata") / "alpaca.jsonl", ALPACA)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def adapted(model_dir, adapter_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_in_fp32_and_4bit_and_merges_exactly(family, family_dir, alpaca, tmp_path, capsys):
    base = family_dir[family]
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    for precision in ("fp32", "4bit"):
        out = tmp_path / precision
        code, _, err = run_cli(fast_train_args(base, alpaca, out, precision=precision, max_steps=2), capsys)
        assert code == 0, err
        assert "LoRA targets: " in err
        config = json.loads((out / "adapter_config.json").read_text())
        expected = EXPECTED_TARGETS[family]
        assert set(config["target_modules"]) | set(config.get("target_parameters") or []) == expected
        with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        with_adapter = adapted(base, out)
        # One A (and B) per adapted module or tensor in each block; never the head or the router.
        plain = AutoModelForCausalLM.from_pretrained(base)
        instances = [n for n, _ in plain.named_modules() if n.rsplit(".", 1)[-1] in config["target_modules"]]
        instances += [n for n, _ in plain.named_parameters() if any(n.endswith(f"{t}") for t in config.get("target_parameters") or [])]
        assert (
            len([k for k in keys if "lora_A" in k]) == len(set(instances)) == len(expected) * 2 + (2 if family == "gpt2" else 0)
        )  # GPT-2: two c_proj per block
        assert not any("lm_head" in k or ".gate." in k for k in keys)
        lora_b = [p for n, p in with_adapter.named_parameters() if "lora_B" in n]
        assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained: B left its zero init
        merged_dir = tmp_path / f"merged-{precision}"
        code, _, err = run_cli(["merge", "--adapter", out, "--output", merged_dir, "--dtype", "fp32"], capsys)
        assert code == 0, err
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        want, got = logits(with_adapter, ids), logits(merged, ids)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_mixtral_logs_its_bf16_experts_and_refuses_dropout_on_them(family_dir, alpaca, tmp_path, capsys):
    args = fast_train_args(family_dir["mixtral"], alpaca, tmp_path / "o", precision="4bit", max_steps=1)
    code, _, err = run_cli(args, capsys)
    assert code == 0 and "4bit: bitsandbytes quantizes linear layers only; this model's fused MoE expert tensors (" in err
    code, _, err = run_cli(fast_train_args(family_dir["mixtral"], alpaca, tmp_path / "d", dropout=0.05), capsys)
    assert code == 2 and single_error_line(err).startswith("error: --dropout 0.05: LoRA on mlp.experts.down_proj, mlp.experts.gate_up_proj")
    assert not (tmp_path / "d").exists()  # refused before loading


def test_mixtral_router_is_adapted_only_when_named_and_merges(family_dir, alpaca, tmp_path, capsys):
    base, out = family_dir["mixtral"], tmp_path / "router"
    code, _, err = run_cli(fast_train_args(base, alpaca, out, target_modules=["q_proj", "gate"], max_steps=2), capsys)
    assert code == 0, err
    assert json.loads((out / "adapter_config.json").read_text())["target_parameters"] == ["mlp.gate.weight"]
    code, _, err = run_cli(["merge", "--adapter", out, "--output", tmp_path / "m", "--dtype", "fp32"], capsys)
    assert code == 0, err
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    want = logits(adapted(base, out), ids)
    got = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval(), ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    code, _, err = run_cli(fast_train_args(base, alpaca, tmp_path / "bad", target_modules=["q_proj", "nope"]), capsys)
    assert (
        code == 2
        and "--target-modules: nope is not a linear layer or expert tensor of this model; choose from: k_proj o_proj q_proj "
        "v_proj experts gate"
        in err
    )


@pytest.mark.parametrize("family", NO_SYSTEM_ROLE)
def test_templates_without_a_system_role(family, family_dir, tmp_path, capsys):
    """Gemma/Mistral-style templates raise on a system turn: auto merges it into the first user
    turn (and says so); keep gives one error line naming the row and the template's rule."""
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    code, _, err = run_cli(fast_train_args(family_dir[family], chat, tmp_path / "auto", max_steps=1), capsys)
    assert code == 0, err
    code, _, err = run_cli(fast_train_args(family_dir[family], chat, tmp_path / "keep", max_steps=1, system_message="keep"), capsys)
    line = single_error_line(err)
    assert code == 2 and "System role not supported" in line and "row 1" in line and "--system-message merge" in line


def test_quantized_conv1d_models_are_not_streamed_unquantized(family_dir, alpaca, tmp_path, capfd):
    """Layer-by-layer loading swaps nn.Linear for bitsandbytes layers; GPT-2's Conv1D would stay
    full precision, silently: refused with the way out instead (by the launched rank: capfd)."""
    code, _, err = run_cli(
        fast_train_args(family_dir["gpt2"], alpaca, tmp_path / "o", backend="fsdp", precision="4bit", max_steps=1), capfd
    )
    assert code == 2
    assert single_error_line(err) == (
        f"error: --backend fsdp: {family_dir['gpt2']} can't be loaded layer by layer (GPT2Block has GPT-2-style Conv1D layers, "
        "which are quantized only by transformers' whole-model loading); use --zero 3 with --precision bf16, or --zero 2"
    )
