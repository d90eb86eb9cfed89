"""The prepared data: mixing by weight, the eval split, the fingerprint resume checks."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_tune.config import TrainConfig
from lora_tune.data.prepare import prepare_data
from lora_tune.errors import UserError
from lora_tune.options import build_config

from helpers import data_config, write_jsonl


def test_eval_split_is_disjoint_and_seeded(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"sample {i}"} for i in range(20)])
    a = prepare_data(data_config(path, eval_split=0.2), tokenizer)
    b = prepare_data(data_config(path, eval_split=0.2), tokenizer)
    assert len(a.eval) == 4 and len(a.train) == 16
    assert [s.input_ids for s in a.eval] == [s.input_ids for s in b.eval]
    assert not {tuple(s.input_ids) for s in a.eval} & {tuple(s.input_ids) for s in a.train}


def test_fingerprint_changes_with_content(tmp_path, tokenizer):
    p1 = write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    p2 = write_jsonl(tmp_path / "b.jsonl", [{"text": "one"}, {"text": "three"}])
    assert prepare_data(data_config(p1), tokenizer).fingerprint == prepare_data(data_config(p1), tokenizer).fingerprint
    assert prepare_data(data_config(p1), tokenizer).fingerprint != prepare_data(data_config(p2), tokenizer).fingerprint


def test_sources_mix_in_their_weights_deterministically(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"instruction": f"beta {i}", "output": "ok"} for i in range(40)])
    mixed = prepare_data(data_config([str(a), str(b)], data_weights=[3.0, 1.0]), tokenizer)
    alpha = sum("alpha" in tokenizer.decode(s.input_ids) for s in mixed.train)
    assert len(mixed.train) == 80 and alpha == 60  # 3/4 of the combined size: the small share upsampled
    assert len({tuple(s.input_ids) for s in mixed.train if "beta" in tokenizer.decode(s.input_ids)}) == 20  # drawn without repetition
    again = prepare_data(data_config([str(a), str(b)], data_weights=[3.0, 1.0]), tokenizer)
    assert [s.input_ids for s in again.train] == [s.input_ids for s in mixed.train]
    assert mixed.format == "alpaca+text" and len(mixed.per_source) == 2 and "60 in the mix (weight 3.0)" in mixed.per_source[0]
    assert prepare_data(data_config([str(a), str(b)], data_weights=[1.0, 3.0]), tokenizer).fingerprint != mixed.fingerprint
    with pytest.raises(UserError, match="2 weights for 1 sources"):
        prepare_data(data_config([str(a)], data_weights=[1.0, 2.0]), tokenizer)


@pytest.mark.parametrize("where", ["--data-weights", "data_weights: in the file"])
def test_data_weights_win_over_each_source_s_weight_and_the_saved_config_says_so(where, tmp_path, tokenizer):
    """Sources with `weight: 3` / `weight: 1` in YAML and --data-weights 1 1 (or data_weights: [1, 1] in
    the same file) mixed 3:1 while lora_tune_config.yaml recorded [1.0, 1.0] (issue 52)."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"alpha {i}"} for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"beta {i}"} for i in range(40)])
    file = {"base": "tiny-llama", "output_dir": "out", "data": [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}]}
    flags = {"data_weights": [1.0, 1.0]}
    cfg = build_config(TrainConfig, file, flags) if where == "--data-weights" else build_config(TrainConfig, {**file, **flags}, {})
    saved = yaml.safe_load(yaml.safe_dump(cfg.model_dump()))  # what the recipe writes as lora_tune_config.yaml
    assert saved["data_weights"] == [1.0, 1.0] and saved["data"] == [{"path": str(a)}, {"path": str(b)}]
    mixed = prepare_data(cfg, tokenizer)
    alpha = sum("alpha" in tokenizer.decode(s.input_ids) for s in mixed.train)
    assert (len(mixed.train), alpha) == (80, 40) and "40 in the mix (weight 1.0)" in mixed.per_source[0]
    per_source = build_config(TrainConfig, file, {})  # no data_weights anywhere: each source's own weight
    assert (
        per_source.data_weights is None
        and sum("alpha" in tokenizer.decode(s.input_ids) for s in prepare_data(per_source, tokenizer).train) == 60
    )


# --- any rows at all: the data stage answers with samples or one UserError, nothing else -------------------
SCALARS = st.none() | st.booleans() | st.integers(-200, 70_000) | st.floats(allow_nan=True) | st.text(max_size=30)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12
)
COLUMNS = ("text", "instruction", "input", "output", "prompt", "completion", "messages", "conversations", "input_ids", "labels")
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "bot", 3]), "content": SCALARS | VALUES})
ROW = st.fixed_dictionaries(
    {},
    optional={
        **{c: VALUES for c in COLUMNS},
        "text": st.text(max_size=60) | VALUES,
        "messages": st.lists(MESSAGE, max_size=4) | VALUES,
        "input_ids": st.lists(st.integers(-5, 70_000), max_size=12) | VALUES,
        "labels": st.lists(st.integers(-101, 70_000), max_size=12) | VALUES,
    },
)


EXAMPLES = int(os.environ.get("LORA_TUNE_EXAMPLES", 40))  # more for a longer hunt


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(ROW, min_size=1, max_size=4))
def test_any_rows_give_samples_or_one_user_error(rows, tmp_path, tokenizer):
    path = tmp_path / "any.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        prepared = prepare_data(data_config(path, data_cache=False, max_seq_len=64), tokenizer)
    except UserError as e:
        assert "\n" not in str(e) and str(e).startswith("--data"), str(e)
        return
    assert all(len(s.input_ids) == len(s.labels) <= 64 for s in prepared.train)
    assert all(0 <= t < len(tokenizer) for s in prepared.train for t in s.input_ids)
