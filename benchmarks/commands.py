"""What the benchmark scripts share: the `lora-tune train` command they run, as argv, and their
common options (steps, a work folder, the tiny shape the test suite runs)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def bench_options(steps: int, tiny: str, prefix: str, parser: argparse.ArgumentParser | None = None):
    """(options, work folder) of a benchmark with --steps (default `steps`), --workdir (default: a
    new temporary folder named `prefix`...) and --tiny (`tiny`: what the tiny case is)."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tiny", action="store_true", help=f"{tiny} (for the test suite)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return args, work


def train_argv(base: Path, data: Path, out: Path, *extra: str, **options) -> list[str]:
    """`python -m lora_tune train` over `data` into `out`, options as keywords (`max_steps=1`), extra flags as given."""
    argv = [sys.executable, "-m", "lora_tune", "train", "--base", str(base), "--data", str(data), "--output-dir", str(out)]
    for key, value in options.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return [*argv, *extra]
