"""The family sweep's CI subset (benchmarks/family_sweep.py --fast): the dozen most fine-tuned families
and one of each structure (MoE with shared experts, dense first layers and MLA; hybrid linear
attention; image-text wrappers, one without a causal-LM class; Conv1D; Llama 4; a checkpoint stored
under other names and transposed, Ergo), each a tiny random model of transformers' own default
config, through train, merge, plan and packing. Every row is ✓: merged logits == base + adapter
through stock peft, the merged folder stores the base's own tensor names, plan's LoRA count == the
adapter's, no LoRA outside the language model, packing exact where used and the chunked loss only
where the head over the decoder body gives the model's logits."""

from __future__ import annotations

import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from family_sweep import FAST, check_family  # noqa: E402 - a benchmark script, importable once benchmarks/ is on the path


@pytest.mark.parametrize("model_type", FAST)
def test_family(model_type, tmp_path):
    row = check_family(model_type, tmp_path)
    assert row["status"] == "✓", row["reason"]
    plan = row["stages"]["plan"]
    assert plan["trainable"] == plan["adapter"] > 0
    assert row["stages"]["merge"]["drift"] <= 1e-4 and row["stages"]["merge"]["same_names"]
