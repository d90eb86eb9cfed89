"""The `lora-tune train` command the benchmark scripts run, as argv."""

from __future__ import annotations

import sys
from pathlib import Path


def train_argv(base: Path, data: Path, out: Path, *extra: str, **options) -> list[str]:
    """`python -m lora_tune train` over `data` into `out`, options as keywords (`max_steps=1`), extra flags as given."""
    argv = [sys.executable, "-m", "lora_tune", "train", "--base", str(base), "--data", str(data), "--output-dir", str(out)]
    for key, value in options.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return [*argv, *extra]
