"""The typed configuration: defaults, what resume treats as math, and bounds stated in the messages."""

from __future__ import annotations

import pytest

from lora_tune.config import PlanConfig, TrainConfig, bounds, build_config, parse_size
from lora_tune.errors import UserError


def test_defaults_match_the_brief():
    cfg = TrainConfig(base="b", data="d", output_dir="o")
    assert (cfg.precision, cfg.rank, cfg.lora_alpha, cfg.optim, cfg.gradient_checkpointing) == ("bf16", 16, 32.0, "adamw_8bit", True)
    assert cfg.trust_remote_code is False and cfg.allow_bin is False and cfg.target_modules is None
    assert cfg.backend is None and cfg.zero == 0 and cfg.offload == "none" and cfg.dropout == 0.0


def test_math_keys_cover_what_changes_the_result():
    keys = set(TrainConfig.math_keys())
    assert {"base", "data", "rank", "alpha", "precision", "optim", "lr", "micro_batch_size", "grad_accum", "seed", "max_seq_len"} <= keys
    assert not keys & {"max_steps", "epochs", "save_steps", "eval_steps", "logging_steps", "output_dir", "resume"}


@pytest.mark.parametrize(
    "name,words",
    [
        ("rank", "a positive integer"),
        ("lr", "> 0"),
        ("eval_split", "in [0, 1)"),
        ("dropout", "in [0, 1)"),
        ("weight_decay", ">= 0"),
        ("max_steps", "a positive integer"),
        ("loss_chunk_size", ">= 0"),
    ],
)
def test_bounds_are_read_from_the_fields_constraints(name, words):
    assert bounds(TrainConfig.model_fields[name]) == words


@pytest.mark.parametrize(
    "values,message",
    [
        (dict(rank=0), "--rank: must be a positive integer (got 0); typical values are 8, 16, 32, 64"),
        (dict(lr=-1.0), "--lr: must be > 0 (got -1.0); LoRA usually trains with 1e-4 to 3e-4"),
        (dict(save_total_limit=0), "--save-total-limit: must be a positive integer (got 0); leave it out to disable"),
        (
            dict(loss_chunk_size=-2),
            "--loss-chunk-size: must be >= 0 (got -2); 0 computes the full logits; leave it out for the automatic size",
        ),
        (dict(data=[]), "--data: give at least one value (got [])"),
        (dict(target_modules=["lm_head"]), "--target-modules: give module names such as q_proj v_proj (lm_head is never adapted)"),
        (dict(precision="int3"), "--precision: got 'int3'; input should be 'fp32', 'bf16', 'fp16', '8bit' or '4bit'"),
    ],
)
def test_each_invalid_value_is_one_message_naming_the_flag(values, message):
    with pytest.raises(UserError) as e:
        build_config(TrainConfig, {}, {"base": "b", "data": "d", "output_dir": "o", **values})
    assert str(e.value).startswith(message), str(e.value)


def test_plan_takes_every_train_option_without_data_or_output():
    cfg = build_config(PlanConfig, {}, {"base": "llama-8b", "rank": 8, "gpus": 2})
    assert cfg.data is None and cfg.output_dir is None and cfg.rank == 8 and cfg.gpus == 2
    with pytest.raises(UserError, match="--gpus: must be a positive integer"):
        build_config(PlanConfig, {}, {"base": "llama-8b", "gpus": 0})


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("100MiB", 100 * 2**20), ("80 GiB", 80 * 2**30), ("1234B", 1234)])
def test_sizes_parse_with_their_units(text, size):
    assert parse_size(text, "--max-shard-size") == size


@pytest.mark.parametrize("text", ["5", "24", " 2.5 ", 1234])
def test_a_bare_number_is_refused_never_read_as_bytes(text):
    with pytest.raises(UserError, match=r"--max-shard-size: .* has no unit; write e.g. [0-9.]+GB or [0-9.]+GiB"):
        parse_size(text, "--max-shard-size")


@pytest.mark.parametrize("text", ["huge", "-5GB", "5 parsecs"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(UserError, match="--max-shard-size: .* is not a size; write e.g. 5GB"):
        parse_size(text, "--max-shard-size")
