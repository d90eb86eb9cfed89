"""The typed configuration: defaults, what resume treats as math, and bounds stated in the messages."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lora_tune
from lora_tune.after.options import MergeConfig
from lora_tune.config import PlanConfig, TrainConfig
from lora_tune.errors import UserError
from lora_tune.options import bounds, build_config, parse_size, read_yaml


def test_defaults_match_the_brief():
    cfg = TrainConfig(base="b", data="d", output_dir="o")
    # Checkpointing: as many layers as the memory plan needs (every one on a CPU); YAML's true / false still mean on / off.
    assert (cfg.precision, cfg.rank, cfg.lora_alpha, cfg.optim, cfg.gradient_checkpointing) == ("bf16", 16, 32.0, "adamw_8bit", "auto")
    assert [TrainConfig(base="b", data="d", output_dir="o", gradient_checkpointing=v).gradient_checkpointing for v in (True, False)] == [
        "on",
        "off",
    ]
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


# --- any configuration at all: a config or one UserError, nothing else ---------------------------------------
SCALARS = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=20)
VALUES = SCALARS | st.lists(SCALARS, max_size=3) | st.dictionaries(st.text(max_size=6), SCALARS, max_size=3)


def option_dicts(schema):
    names = st.sampled_from(sorted(schema.model_fields)) | st.text(max_size=12)
    return st.dictionaries(names, VALUES, max_size=6)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_configuration_is_a_config_or_one_user_error(data):
    schema = data.draw(st.sampled_from([TrainConfig, PlanConfig, MergeConfig]))
    try:
        build_config(schema, data.draw(option_dicts(schema)), data.draw(option_dicts(schema)))
    except UserError as e:
        assert "\n" not in str(e), str(e)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_config_file_is_a_mapping_or_one_user_error(content, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    try:
        assert isinstance(read_yaml(str(path)), dict)
    except UserError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)


PLAN_OPTIONS = st.fixed_dictionaries(
    {"base": st.sampled_from(["llama-8b", "mixtral-8x7b", "phi3-mini"])},
    optional={
        "precision": st.sampled_from(["bf16", "fp16", "fp32", "8bit", "4bit", "int3"]),
        "zero": st.integers(-1, 4),
        "backend": st.sampled_from(["single", "deepspeed", "fsdp", "horovod"]),
        "offload": st.sampled_from(["none", "cpu", "nvme"]),
        "gpus": st.integers(-1, 64),
        "nodes": st.integers(0, 8),
        "rank": st.integers(-1, 4096),
        "micro_batch_size": st.integers(0, 512),
        "max_seq_len": st.integers(0, 2**20),
        "gradient_checkpointing": st.booleans(),
        "loss_chunk_size": st.integers(-1, 10**6),
        "gpu_memory": st.sampled_from(["24", "4090", "a100", "80GB", "0GB", "h200", "lots", "1e3GB"]),
        "cpu_memory": st.sampled_from(["512", "512GB", "1TiB", "x"]),
    },
)


@settings(max_examples=60, deadline=None)
@given(options=PLAN_OPTIONS)
def test_any_plan_is_a_plan_or_one_user_error(options):
    try:
        plan = lora_tune.plan(**options)
    except UserError as e:
        assert "\n" not in str(e), str(e)
        return
    assert plan.per_device["total_bytes"] > 0
