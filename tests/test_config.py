"""Config: flags and YAML keys are one schema; unknown keys fail with a suggestion; flags win."""

from __future__ import annotations

import pytest

from lora_tune.cli import build_parser, config_from_args
from lora_tune.config import TrainConfig, flag
from lora_tune.errors import UserError


def parse(argv):
    return config_from_args(TrainConfig, build_parser().parse_args(argv))


def test_flags_override_yaml(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("base: tiny-llama\ndata: d.jsonl\noutput_dir: out\nrank: 8\nlr: 0.001\ntarget_modules: [q_proj, v_proj]\n")
    cfg = parse(["train", "--config", str(cfg_file), "--rank", "32", "--no-gradient-checkpointing"])
    assert cfg.rank == 32 and cfg.lr == 0.001 and cfg.gradient_checkpointing is False
    assert cfg.target_modules == ["q_proj", "v_proj"]
    assert cfg.lora_alpha == 64  # default alpha follows the overridden rank


def test_unknown_yaml_key_suggests_the_right_one(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("base: tiny-llama\ndata: d.jsonl\noutput_dir: out\nlearning_rat: 0.1\nmax_seq_length: 10\n")
    with pytest.raises(UserError, match=r"unknown key 'learning_rat'"):
        parse(["train", "--config", str(cfg_file)])
    cfg_file.write_text("base: tiny-llama\ndata: d.jsonl\noutput_dir: out\nmax_seq_length: 10\n")
    with pytest.raises(UserError, match=r"did you mean max_seq_len\?"):
        parse(["train", "--config", str(cfg_file)])


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name, field in TrainConfig.model_fields.items():
        assert flag(name) in text, name
        assert field.description, f"{name} has no help text"


def test_defaults_match_the_brief():
    cfg = TrainConfig(base="b", data="d", output_dir="o")
    assert (cfg.precision, cfg.rank, cfg.lora_alpha, cfg.optim, cfg.gradient_checkpointing) == ("bf16", 16, 32.0, "adamw_8bit", True)
    assert cfg.trust_remote_code is False and cfg.allow_bin is False and cfg.target_modules is None


def test_math_keys_cover_what_changes_the_result():
    keys = set(TrainConfig.math_keys())
    assert {"base", "data", "rank", "alpha", "precision", "optim", "lr", "micro_batch_size", "grad_accum", "seed", "max_seq_len"} <= keys
    assert not keys & {"max_steps", "epochs", "save_steps", "eval_steps", "logging_steps", "output_dir", "resume"}
