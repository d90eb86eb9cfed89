"""`lora-tune export`: GGUF round trips read back by independent readers (gguf's reader, transformers'
GGUF loader), every family exported or refused in one line, gguf-lora and Ollama folders, atomic output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma2Config

import lora_tune
from lora_tune.after.export import gguf as gguf_format
from lora_tune.after.export.gguf_check import FIXED_TEXT, RoundTrip, compare, fixed_prompts, gguf_logits, reading_config
from lora_tune.after.export.gguf_lora import read_adapter_gguf
from lora_tune.after.export.ollama import CHECK_CONVERSATION, predict, render, turn_pieces
from lora_tune.cli import main
from lora_tune.errors import UserError
from lora_tune.models.tiny.model import _CORPUS

from families import FAMILIES, build_family
from helpers import TEXT, fast_train_args, run_cli, single_error_line, write_jsonl

gguf = pytest.importorskip("gguf", reason="the gguf package is an optional extra (lora-tune[export])")

EXPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2")


def trained_family(name: str, out: Path, steps: int = 60) -> Path:
    """A tiny family model trained in full for a few steps on the tokenizer's corpus, so its next-token
    predictions are peaked like a real model's (on a random model greedy tokens are near-ties that any
    rounding flips, and agreement measures nothing). Gemma-2 gets query_pre_attn_scalar = head_dim,
    the value llama.cpp computes with (the families.py default, 256, is refused: see below)."""

    random = build_family(name, out.with_name(out.name + "-random"))
    config = AutoConfig.from_pretrained(random)
    if name == "gemma2":
        config.query_pre_attn_scalar = config.head_dim
    tokenizer = AutoTokenizer.from_pretrained(random)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.tensor(tokenizer(" ".join(_CORPUS * 3))["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=generator)
        batch = torch.stack([ids[s : s + 64] for s in starts])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained-families")
    return {name: trained_family(name, root / name) for name in EXPORTED}


def merged_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=ids).logits


def read_back_logits(path: Path, source_config: dict, ids: torch.Tensor) -> torch.Tensor:
    config, _ = reading_config(path, source_config)
    return gguf_logits(path, ids, config)


ROUND_TRIPS = [(family, "f16") for family in EXPORTED] + [(family, "q8_0") for family in ("llama", "qwen2", "gemma2", "mistral")]


@pytest.mark.parametrize("family,quant", ROUND_TRIPS)
def test_every_exported_family_round_trips(family, quant, trained, tmp_path, capsys):

    source = trained[family]
    out = tmp_path / f"{family}.gguf"
    code, _, err = run_cli(["export", source, "--format", "gguf", "--quant", quant, "--output", out], capsys)
    assert code == 0, err
    assert "verify: logits through transformers' GGUF loader" in err and "tokenizer ids equal" in err
    # Independently of the command's own check: gguf's reader, then transformers' GGUF loader.
    reader = gguf.GGUFReader(out)
    want_type = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[quant]
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert matrices and all(t.tensor_type == want_type for t in matrices), {t.name: t.tensor_type.name for t in matrices}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors if len(t.shape) == 1)
    assert reader.fields["tokenizer.chat_template"].contents() == AutoTokenizer.from_pretrained(source).chat_template
    config = json.loads((source / "config.json").read_text())
    ids = fixed_prompts(source, config["vocab_size"])
    want, got = merged_logits(source, ids), read_back_logits(out, config, ids)
    relative = float((got - want).abs().max() / want.abs().max())
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    if quant == "f16":
        assert relative < 1e-2, relative
    assert agreement >= 0.99, agreement
    assert relative < 3e-2  # q8_0 too: a layout or name mistake gives O(1)
    tokenizer = AutoTokenizer.from_pretrained(source)
    rebuilt = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    assert rebuilt(FIXED_TEXT, add_special_tokens=False)["input_ids"] == tokenizer(FIXED_TEXT, add_special_tokens=False)["input_ids"]


def test_q8_0_of_a_near_flat_model_is_checked_where_the_model_is_confident(tiny_model, tmp_path, capsys):
    """The random tiny Llama's logits are near-flat: q8_0's rounding flips near-ties, and greedy agreement
    over every position was 98.3% < 99%, a false refusal (issue 52). Where the model is confident, q8_0
    agrees on every position."""
    result = lora_tune.export(tiny_model, output=str(tmp_path / "flat.gguf"), quant="q8_0")
    assert result.greedy_agreement == pytest.approx(0.983, abs=0.002) and result.greedy_agreement < 0.99
    assert result.confident_agreement == 1.0 and result.confident_positions == 174
    assert result.max_rel_logit_diff < 3e-2 and (tmp_path / "flat.gguf").read_bytes()[:4] == b"GGUF"


def test_a_q8_0_flip_where_the_model_is_confident_is_refused_naming_no_verify():
    want = torch.zeros(1, 100, 8)
    want[0, :, 0] = 10.0  # top token 0, leading by 10: confident everywhere
    want[0, :50, 1] = 9.99  # ... but at the first 50 positions a near-tie with token 1
    want[0, 60, 1] = 9.7  # a lead of 0.3 (3% of the largest logit): confident
    near_tie_flips = want.clone()
    near_tie_flips[0, :3, 1] = 10.01
    result = RoundTrip(1)
    compare(near_tie_flips, want, "q8_0", result)
    assert result.greedy_agreement == pytest.approx(0.97) and result.confident_positions == 50 and result.confident_agreement == 1.0
    confident_flip = want.clone()
    confident_flip[0, 60, 1] = 10.1  # drift 0.04 relative: within q8_0's tolerance, but a confident position flips
    with pytest.raises(UserError) as refused:
        compare(confident_flip, want, "q8_0", RoundTrip(1))
    assert "on 98.0% of the 50 positions where the merged model is confident" in str(refused.value)
    assert str(refused.value).endswith("--no-verify writes the file without this check")


def test_bf16_round_trip_and_file_types(trained, tmp_path, capsys):
    out = tmp_path / "llama-bf16.gguf"
    code, _, err = run_cli(["export", trained["llama"], "--quant", "bf16", "--output", out], capsys)
    assert code == 0, err
    reader = gguf.GGUFReader(out)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {gguf.GGMLQuantizationType.BF16}
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    config = json.loads((trained["llama"] / "config.json").read_text())
    want, got = merged_logits(trained["llama"], ids), read_back_logits(out, config, ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2


def test_a_missing_rotary_permutation_is_caught(trained, tmp_path, capsys, monkeypatch):
    """The independent reader reverses llama.cpp's Q/K permutation; without ours the logits drift and
    nothing is written."""
    monkeypatch.setattr(gguf_format, "permute_rotary", lambda weights, n_head, n_head_kv: weights)
    out = tmp_path / "unpermuted.gguf"
    code, _, err = run_cli(["export", trained["llama"], "--output", out], capsys)
    assert code == 1 and "verification failed" in single_error_line(err)
    assert not out.exists() and not list(tmp_path.glob(".unpermuted*"))


@pytest.mark.parametrize("family,expected", [("mixtral", "Mixtral"), ("gpt_neox", "GPT-NeoX"), ("gemma2", "query_pre_attn_scalar 256")])
def test_refused_families_say_why_in_one_line(family, expected, tmp_path, capsys):
    source = build_family(family, tmp_path / family)
    out = tmp_path / "out.gguf"
    code, _, err = run_cli(["export", source, "--output", out], capsys)
    assert code == 2
    line = single_error_line(err)
    assert expected in line and ("merged folder" in line or "Serve the merged" in line)
    assert not out.exists() and not list(tmp_path.glob(".out.gguf*"))


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_gemma2_without_soft_capping_is_refused_and_a_missing_cap_is_written_as_transformers_default(key, trained, tmp_path, capsys):
    """llama.cpp's gemma2 always soft-caps (cap * tanh(x / cap)), so no GGUF runs a Gemma-2 whose cap
    is null. Unrefused, null was written as 0 (llama.cpp: scores or logits zeroed) while transformers'
    GGUF reader, which has no key for the caps, ran its defaults: on the trained model the logits
    drifted 2.5e-2 (final cap) or passed at 5.7e-3 (attention cap). A cap config.json lacks is
    transformers' default, and is written as that, not as 0."""
    config = json.loads((trained["gemma2"] / "config.json").read_text())
    uncapped = tmp_path / "uncapped"
    shutil.copytree(trained["gemma2"], uncapped)
    (uncapped / "config.json").write_text(json.dumps({**config, key: None}))
    out = tmp_path / "uncapped.gguf"
    code, _, err = run_cli(["export", uncapped, "--output", out], capsys)
    assert code == 2, err
    line = single_error_line(err)
    assert f"{key} null" in line and "Serve the merged folder" in line
    assert not out.exists() and not list(tmp_path.glob(".uncapped.gguf*"))

    default = tmp_path / "default"
    shutil.copytree(trained["gemma2"], default)
    (default / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != key}))
    out = tmp_path / "default.gguf"
    code, _, err = run_cli(["export", default, "--output", out], capsys)
    assert code == 0, err
    assert gguf.GGUFReader(out).fields[f"gemma2.{key}"].contents() == getattr(Gemma2Config(), key) == config[key]


def test_default_families_models_export_unless_refused(tmp_path, capsys):
    """The tests/families.py models themselves (random weights): exported and verified or refused."""
    outcome = {}
    for family in FAMILIES:
        code, _, err = run_cli(["export", build_family(family, tmp_path / family), "--output", tmp_path / f"{family}.gguf"], capsys)
        outcome[family] = code
        assert code == 0 or (code == 2 and single_error_line(err)), (family, err)
    assert outcome == {"llama": 0, "qwen2": 0, "qwen3": 0, "mistral": 0, "mixtral": 2, "gemma2": 2, "phi3": 0, "gpt_neox": 2, "gpt2": 0}


@pytest.fixture(scope="module")
def run_dir(trained, tmp_path_factory):
    """A LoRA run on the trained tiny Llama, through the CLI."""

    root = tmp_path_factory.mktemp("export-run")
    data = write_jsonl(root / "text.jsonl", TEXT)
    assert main([str(a) for a in fast_train_args(trained["llama"], data, root / "run", max_steps=3, lr=5e-2)]) == 0
    return root / "run"


def test_export_from_a_run_merges_on_the_fly_and_matches_base_plus_adapter(run_dir, trained, tmp_path, capsys):

    result = lora_tune.export(source=str(run_dir), output=str(tmp_path / "run.gguf"), quant="f16")
    assert result.path == tmp_path / "run.gguf" and result.token_ids_equal is True
    assert result.max_rel_logit_diff < 1e-2 and result.greedy_agreement >= 0.99
    config = json.loads((trained["llama"] / "config.json").read_text())
    ids = fixed_prompts(run_dir, config["vocab_size"])
    with torch.no_grad():
        want = (
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained["llama"], dtype=torch.float32), run_dir)
            .eval()(input_ids=ids)
            .logits
        )
        base = AutoModelForCausalLM.from_pretrained(trained["llama"], dtype=torch.float32).eval()(input_ids=ids).logits
    got = read_back_logits(result.path, config, ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2
    assert float((base - want).abs().max() / want.abs().max()) > 5e-2, "the adapter must change the model, or the test proves nothing"


def test_gguf_lora_applied_as_llama_cpp_does_equals_base_plus_adapter(run_dir, tmp_path, capsys):
    out = tmp_path / "adapter.gguf"
    code, _, err = run_cli(["export", run_dir, "--format", "gguf-lora", "--output", out], capsys)
    assert code == 0, err
    assert "applied as llama.cpp applies it" in err
    pairs, alpha = read_adapter_gguf(out)
    adapter_config = json.loads((run_dir / "adapter_config.json").read_text())
    assert alpha == adapter_config["lora_alpha"]
    assert len(pairs) == 2 * 7  # 2 layers x q k v o gate up down
    a, b = pairs["blk.0.attn_v.weight"]
    assert a.shape == (adapter_config["r"], 64) and b.shape == (32, adapter_config["r"])
    code, _, err = run_cli(["export", run_dir, "--format", "gguf-lora", "--quant", "q8_0", "--output", tmp_path / "q.gguf"], capsys)
    assert code == 2 and "f16 or bf16" in single_error_line(err)


def test_ollama_folder_has_the_gguf_and_a_modelfile_whose_template_predicts_the_chat_template(trained, tmp_path, capsys):

    for family in ("llama", "gemma2"):  # a template with a system role, and one without (Gemma-style)
        out = tmp_path / f"ollama-{family}"
        code, _, err = run_cli(["export", trained[family], "--format", "ollama", "--output", out], capsys)
        assert code == 0, err
        text = (out / "Modelfile").read_text()
        assert (out / "model.gguf").is_file() and "FROM ./model.gguf" in text
        assert 'PARAMETER stop "</s>"' in text and 'TEMPLATE """' in text and "{{ .Content }}" in text
        assert "{{-" not in text, "trim markers would eat the turns' own newlines"
        tokenizer = AutoTokenizer.from_pretrained(trained[family])
        pieces = turn_pieces(tokenizer)
        conversation = CHECK_CONVERSATION[1:] if pieces.system_in_user else CHECK_CONVERSATION
        assert predict(pieces, conversation, True) == render(tokenizer, conversation, True)
        assert pieces.system_in_user == (family == "gemma2")


def test_ollama_refuses_a_template_it_cannot_translate(trained, tmp_path, capsys):
    source = tmp_path / "numbered"
    shutil.copytree(trained["llama"], source)
    (source / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ loop.index }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    code, _, err = run_cli(["export", source, "--format", "ollama", "--output", tmp_path / "o"], capsys)
    assert code == 2 and "--format gguf" in single_error_line(err)
    assert not (tmp_path / "o").exists()


def test_output_rules(trained, tmp_path, capsys):
    existing = tmp_path / "x.gguf"
    existing.write_text("user data")
    cases = [
        (["export", trained["llama"], "--output", existing], "--overwrite"),
        (["export", trained["llama"], "--output", tmp_path / "x.bin"], "FILE.gguf"),
        (["export", tmp_path / "nope", "--output", tmp_path / "y.gguf"], "does not exist"),
        (["export", tmp_path, "--output", tmp_path / "z.gguf"], "neither an adapter"),
        (["export", trained["llama"], "--quant", "q4", "--output", tmp_path / "w.gguf"], "--quant"),
    ]
    for argv, expected in cases:
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and expected in single_error_line(err), (argv, err)
    assert existing.read_text() == "user data"
    code, _, err = run_cli(["export", trained["llama"], "--output", existing, "--overwrite"], capsys)
    assert code == 0, err
    assert existing.read_bytes()[:4] == b"GGUF"


def test_llama_cpp_python_runs_the_file_when_installed(trained, tmp_path, capsys):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (it builds from source)")

    out = tmp_path / "llama.gguf"
    assert run_cli(["export", trained["llama"], "--output", out], capsys)[0] == 0
    ids = fixed_prompts(trained["llama"], 512)[0].tolist()
    model = llama_cpp.Llama(model_path=str(out), logits_all=True, verbose=False, n_ctx=128)
    assert (
        model.tokenize(b"The quick brown fox", add_bos=False)
        == AutoTokenizer.from_pretrained(trained["llama"])("The quick brown fox", add_special_tokens=False)["input_ids"]
    )
    model.eval(ids)
    got = torch.tensor(model.scores[: len(ids)])
    want = merged_logits(trained["llama"], torch.tensor([ids]))[0]
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.99
