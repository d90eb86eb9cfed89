"""What a model supports, decided by what it does: packing is probed on a tiny random model of the
same class; the attention kernels; the base loaded frozen in its precision."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, BloomConfig, LlamaConfig, MambaConfig, MambaForCausalLM

import lora_tune.models.loading as model_loading
from lora_tune.errors import UserError
from lora_tune.models.loading import attention_implementation, checkpointing_refusal, load_base_model, packing_refusal
from lora_tune.models.tiny.model import build_tiny_model, train_tiny_tokenizer

from helpers import fast_train_args, read_metrics, run_cli


@pytest.mark.parametrize(
    "config,verdict",
    [
        (LlamaConfig(), None),
        (AutoConfig.for_model("gpt2"), None),
        (AutoConfig.for_model("mixtral"), None),
        (MambaConfig(), "MambaForCausalLM lets packed samples see each other"),  # recurrent state runs across samples
        (BloomConfig(), "BloomForCausalLM lets packed samples see each other"),  # ALiBi ignores the restarting positions
        (AutoConfig.for_model("qwen3_next"), "Qwen3NextForCausalLM lets packed samples see each other"),  # linear attention layers
    ],
)
def test_packing_is_decided_by_probing_a_tiny_model_of_the_same_class(config, verdict):
    reason = packing_refusal(config)
    assert (reason is None) if verdict is None else reason.startswith(verdict), reason


def test_the_probe_runs_once_per_class_and_shape(monkeypatch):
    config = AutoConfig.for_model("qwen2")
    packing_refusal(config)
    monkeypatch.setattr(model_loading, "packing_probe", lambda *a: pytest.fail("probed twice"))
    assert packing_refusal(config) is None


def test_a_model_whose_samples_leak_trains_on_padded_batches(tmp_path, data_files, capsys):
    folder = tmp_path / "mamba"
    tokenizer = train_tiny_tokenizer()
    config = MambaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    MambaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "run"
    code, _, err = run_cli(fast_train_args(folder, data_files["text"], out, max_steps=1, target_modules=["in_proj", "x_proj"]), capsys)
    assert code == 0, err
    assert "packing off: MambaForCausalLM lets packed samples see each other" in err and "packing on" not in err
    assert read_metrics(out)[0]["step"] == 1


def test_attention_kernels_on_a_cpu():
    config, cpu = LlamaConfig(), torch.device("cpu")

    def choice(name, packing=True):
        return SimpleNamespace(attn_implementation=name, packing=packing, compile=False, sequence_parallel=1)

    assert attention_implementation(choice("auto", packing=False), config, cpu) == "sdpa"
    assert attention_implementation(choice("eager"), config, cpu) == "eager"
    with pytest.raises(UserError, match="flash_attention_2 needs a CUDA GPU"):
        attention_implementation(choice("flash_attention_2"), config, cpu)


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("4bit", torch.uint8)])
def test_the_base_loads_frozen_in_its_precision_without_a_cache(precision, dtype, tiny_model):
    model = load_base_model(str(tiny_model), precision, torch.device("cpu"))
    assert not any(p.requires_grad for p in model.parameters()) and model.config.use_cache is False
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == dtype


def test_a_model_that_cannot_checkpoint_trains_without_it_under_auto_and_refuses_on(tmp_path, data_files, capsys):
    """CTRL's class says it doesn't support gradient checkpointing: auto turns it off and says so;
    an explicit `on` is one error line before loading."""
    base = build_tiny_model("ctrl", tmp_path / "ctrl")
    assert checkpointing_refusal(AutoConfig.for_model("ctrl")) == "CTRLLMHeadModel does not support gradient checkpointing (transformers)"
    assert checkpointing_refusal(LlamaConfig()) is None
    code, _, err = run_cli(fast_train_args(base, data_files["alpaca"], tmp_path / "on", max_steps=1, gradient_checkpointing="on"), capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: --gradient-checkpointing on: CTRLLMHeadModel does not support gradient checkpointing"
    ), err
    assert not (tmp_path / "on").exists()
    out = tmp_path / "auto"
    code, _, err = run_cli(fast_train_args(base, data_files["alpaca"], out, max_steps=1), capsys)
    assert code == 0, err
    assert "gradient checkpointing off: CTRLLMHeadModel does not support gradient checkpointing" in err
    assert read_metrics(out)[0]["step"] == 1


def test_a_base_missing_weights_is_refused_not_filled_at_random(tiny_model, tmp_path):
    """transformers fills tensors the files lack with random values and goes on; lora-tune refuses."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    weights = load_file(str(base / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        UserError, match=r"has no weights for 1 tensors LlamaForCausalLM needs \(e.g. model.layers.1.mlp.down_proj.weight\)"
    ):
        load_base_model(str(base), "fp32", torch.device("cpu"))
