"""LoRA targets come from the model (lora_tune.models.targets): resolved and refused against the
model's own linears, experts and routers, in a form peft adapts exactly as asked and loads back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.models.llama4.modeling_llama4 import Llama4Router

from lora_tune.config import TrainConfig
from lora_tune.errors import UserError
from lora_tune.models import targets as targets_module
from lora_tune.models.loading import load_config
from lora_tune.models.structure import meta_model
from lora_tune.models.targets import (
    Inventory,
    adaptation_mismatch,
    base_name,
    check_loads_back,
    inject_on_meta,
    is_plain_linear,
    lora_targets,
    peft_exact_targets,
    resolve_targets,
)
from lora_tune.models.tiny.configs import shrink_config

from families import build_family
from helpers import TEXT, adapter_tensors, fast_train_args, run_cli, write_jsonl


def options(**kw):
    return SimpleNamespace(**{"target_modules": None, "dropout": 0.0, "dora": False, **kw})


@pytest.fixture(scope="module")
def gpt2_and_mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-families")
    return {name: load_config(str(build_family(name, root / name))) for name in ("gpt2", "mixtral")}


def test_the_default_targets_are_every_block_linear_and_the_experts(tiny_model, gpt2_and_mixtral):
    llama = resolve_targets(meta_model(load_config(str(tiny_model))), options())
    assert set(llama.modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} and llama.parameters == ()
    mixtral = resolve_targets(meta_model(gpt2_and_mixtral["mixtral"]), options())
    assert set(mixtral.parameters) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} and "gate" not in mixtral.modules
    inventory = Inventory.of(meta_model(gpt2_and_mixtral["mixtral"]))
    assert inventory.routers == ("mlp.gate",)


def test_targets_outside_the_model_are_refused_with_its_own_list(gpt2_and_mixtral):
    with pytest.raises(UserError, match="q_proj is not a linear layer .* choose from: c_attn c_fc c_proj"):
        resolve_targets(meta_model(gpt2_and_mixtral["gpt2"]), options(target_modules=["q_proj"]))


def test_expert_tensors_refuse_dropout_dora_and_weight_based_inits(gpt2_and_mixtral):
    skeleton = meta_model(gpt2_and_mixtral["mixtral"])
    with pytest.raises(UserError, match="--dropout 0.05: LoRA on mlp.experts"):
        resolve_targets(skeleton, options(dropout=0.05))
    with pytest.raises(UserError, match="--dora: peft has no DoRA for fused expert/router tensors"):
        resolve_targets(skeleton, options(dora=True))
    with pytest.raises(UserError, match="--init-lora-weights pissa: peft's init works on a linear layer's weight"):
        resolve_targets(skeleton, options(init_lora_weights="pissa"))
    assert resolve_targets(skeleton, options(init_lora_weights="gaussian")).parameters  # A's values alone: fine for experts


def test_pefts_moe_target_rewrite_is_avoided_so_every_requested_linear_is_adapted():
    """peft 0.21 rewrites the targets of MoE types whose checkpoints transformers fuses: DeepSeek-V3's
    dense first layers and shared experts lose gate/up/down_proj and the fused gate_up experts get
    rank 2r. Named as target_parameters by their block path those linears are adapted, at rank r,
    exactly as asked (and counted by plan); under 4-bit that way is closed: refused in one line."""
    config = shrink_config(CONFIG_MAPPING["deepseek_v3"]())
    cfg = options(rank=4, lora_alpha=8, rslora=False, precision="fp32")
    asked = resolve_targets(meta_model(config), cfg)
    wanted, adapted = inject_on_meta(config, cfg, asked)
    assert adaptation_mismatch(dict.fromkeys(wanted, 4), adapted) == (
        "12 left out (e.g. model.layers.0.mlp.down_proj.weight), 2 at rank 8 instead of 4 (e.g. model.layers.2.mlp.experts.gate_up_proj)"
    )
    exact = peft_exact_targets(config, cfg, asked)
    assert set(exact.parameters) - set(asked.parameters) == {
        f"mlp.{expert}{proj}.weight" for expert in ("", "shared_experts.") for proj in ("gate_proj", "up_proj", "down_proj")
    }
    assert inject_on_meta(config, cfg, exact) == (wanted, dict.fromkeys(wanted, 4))
    with pytest.raises(UserError, match="--precision 4bit: peft rewrites the LoRA targets of deepseek_v3 models"):
        peft_exact_targets(config, options(rank=4, lora_alpha=8, rslora=False, precision="4bit"), asked)
    assert len(exact.parameters) == len(set(exact.parameters))  # each tensor named once


def test_pefts_moe_rewrite_in_an_image_text_wrapper_is_avoided_inside_the_language_model_only():
    """GLM-4.5V: the same rewrite, but the vision tower's blocks have `mlp.down_proj` too; the moved
    linears are named by their full path, so nothing outside the language model is adapted."""
    config = shrink_config(CONFIG_MAPPING["glm4v_moe"]())
    cfg = options(rank=4, lora_alpha=8, rslora=False, precision="fp32")
    asked = resolve_targets(meta_model(config), cfg)
    wanted, _ = inject_on_meta(config, cfg, asked)
    exact = peft_exact_targets(config, cfg, asked)
    assert all(p.startswith("model.language_model.layers.") for p in set(exact.parameters) - set(asked.parameters))
    assert inject_on_meta(config, cfg, exact) == (wanted, dict.fromkeys(wanted, 4))
    assert not any(n.startswith("model.visual") for n in wanted)


def test_linear_subclasses_count_as_linears_when_they_map_like_one():
    """Falcon's FalconLinear (its own forward, the same product) is a LoRA target; DeepSeek-V4's
    grouped projection (an nn.Linear that reshapes its input into groups) is not; both decided on
    the meta device, whatever device the module is on."""
    for device in ("cpu", "meta"):
        with torch.device(device):
            assert is_plain_linear(FalconLinear(8, 16)) and is_plain_linear(torch.nn.Linear(8, 16))
            assert not is_plain_linear(DeepseekV4GroupedLinear(8, 16, 2)) and not is_plain_linear(DeepseekV4GroupedLinear(8, 16, 7))
            assert not is_plain_linear(Llama4Router(shrink_config(CONFIG_MAPPING["llama4_text"]())))  # returns (scores, logits)
    config = shrink_config(CONFIG_MAPPING["falcon"]())
    assert set(resolve_targets(meta_model(config), options()).modules) == {"dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"}


def test_an_adapter_peft_would_not_load_back_is_refused_before_loading():
    """peft 0.21 renames adapter keys with transformers' conversion mapping on load; for Laguna the
    pattern `mlp.shared_expert.` also matches `mlp.shared_experts.`, so the shared experts' LoRA
    would be dropped by PeftModel.from_pretrained and by resume: refused in one line. Llama and
    DeepSeek-V3 (with the MoE rewrite avoided) load back whole."""
    cfg = options(rank=4, lora_alpha=8, rslora=False, precision="fp32")
    for model_type in ("llama", "deepseek_v3"):
        config = shrink_config(CONFIG_MAPPING[model_type]())
        check_loads_back(config, cfg, peft_exact_targets(config, cfg, resolve_targets(meta_model(config), cfg)))
    config = shrink_config(CONFIG_MAPPING["laguna"]())
    with pytest.raises(UserError, match=r"could not load this laguna model's adapter back: .* would drop 12 of 56 LoRA tensors"):
        check_loads_back(config, cfg, peft_exact_targets(config, cfg, resolve_targets(meta_model(config), cfg)))


def test_checking_a_runs_targets_injects_them_once(tiny_model, monkeypatch):
    """Resolving the default targets, the exact-targets check and the load-back check share one meta
    injection (they built four and five meta models before: 1.0 s -> 0.26 s for Llama-3.1-8B's
    config); the load-back check still refuses what it refused (above)."""
    config = load_config(str(tiny_model))
    built, injected = [], []
    monkeypatch.setattr(targets_module, "meta_model", lambda c: built.append(c) or meta_model(c))
    monkeypatch.setattr(targets_module, "get_peft_model", lambda *a, **k: injected.append(a) or get_peft_model(*a, **k))
    cfg = TrainConfig(base=str(tiny_model), data="d.jsonl", output_dir="o")
    resolved = lora_targets(cfg, config)
    assert set(resolved.modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (len(built), len(injected)) == (2, 1)  # the inventory's skeleton, and the one injected


def test_base_names_drop_the_peft_wrapping():
    # Fused experts with two adapted parameters are wrapped twice; a wrapper's own module name ends in one.
    assert base_name("peft_model.base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj") == (
        "model.layers.0.mlp.experts.gate_up_proj"
    )
    assert base_name("peft_model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert base_name("base_model.model.model.layers.0.mlp.experts.base_layer") == "model.layers.0.mlp.experts"


def test_patterns_layers_tokens_and_modules_to_save_shape_the_adapter_and_merge_as_peft(tiny_model, tmp_path, capsys):
    """--rank-pattern / --alpha-pattern / --layers-to-transform / --trainable-tokens / --modules-to-save
    reach peft as its own options: the adapter holds exactly the tensors they ask for, and merges (rows
    of the trained tokens, the saved lm_head) into what peft computes with it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    token = tokenizer.all_special_tokens[0]
    patterns = dict(
        rank_pattern=["down_proj=8", r"layers\.1\.self_attn\.q_proj=2"],
        alpha_pattern=["v_proj=32"],
        layers_to_transform=["1"],
        trainable_tokens=[token],
        modules_to_save=["lm_head"],
    )
    data = write_jsonl(tmp_path / "text.jsonl", TEXT)
    code, _, err = run_cli(fast_train_args(tiny_model, data, tmp_path / "run", max_steps=2, lr=5e-2, **patterns), capsys)
    assert code == 0, err
    shapes = {k.removeprefix("base_model.model."): tuple(t.shape) for k, t in adapter_tensors(tmp_path / "run").items()}
    ranks = {"down_proj": 8, "q_proj": 2}
    expected = {"lm_head.weight": (512, 64), "model.embed_tokens.token_adapter.trainable_tokens_delta": (1, 64)}
    for module, (inputs, outputs) in {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                                      "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}.items():  # fmt: skip
        part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        r = ranks.get(module, 4)
        expected[f"model.layers.1.{part}.{module}.lora_A.weight"] = (r, inputs)
        expected[f"model.layers.1.{part}.{module}.lora_B.weight"] = (outputs, r)
    assert shapes == expected  # layer 0 untouched, the patterns' ranks, one token's row, the whole lm_head
    config = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == [tokenizer.convert_tokens_to_ids(token)] and config["alpha_pattern"] == {"v_proj": 32}
    code, _, err = run_cli(["merge", "--adapter", tmp_path / "run", "--output", tmp_path / "merged", "--dtype", "fp32"], capsys)
    assert code == 0, err
    usual = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "run").merge_and_unload().state_dict()
    ours = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert not torch.equal(ours["model.embed_tokens.weight"], load_file(str(tiny_model / "model.safetensors"))["model.embed_tokens.weight"])
    for k in ours:
        torch.testing.assert_close(ours[k], usual[k], rtol=0, atol=1e-6, msg=k)
