"""What the benchmark scripts share: the `lora-tune train` command they run, as argv, their common
options (steps, a work folder, the tiny shape the test suite runs), and how a route's code runs."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What the routes import. A tiny run (the test suite) forks its routes from a server that imported
# these once: each fresh interpreter pays about 7 s on 2 cores for them (peft imports bitsandbytes,
# which imports torch's compiler), more than a tiny route's training.
PRELOAD = [
    "torch",
    "transformers",
    "transformers.trainer",
    "transformers.models.llama.modeling_llama",
    "peft",
    "bitsandbytes",
    "datasets",
    "trl",
    "lora_tune.cli",
    "lora_tune.preflight",
    "lora_tune.training.recipe",
    "lora_tune.engines.single",
]


def run_python(script: str, args: list[str], preloaded: bool = False, python: str | None = None, watch=None) -> subprocess.CompletedProcess:
    """`python -c script *args`, its output captured: in a fresh interpreter (a real run: each route's
    peak RSS is its own), or, `preloaded`, in a child forked from a server that has imported PRELOAD
    (never having run anything, so the fork is safe), whose peak RSS includes those imports.
    `python`: another environment's interpreter (vLLM's); `watch(pid)`: called with the fresh
    interpreter's pid once it runs (a sampler of its process tree)."""
    if not preloaded:
        proc = subprocess.Popen([python or sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if watch is not None:
            watch(proc.pid)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as folder:
        child = context.Process(target=_run_script, args=(script, args, folder))
        child.start()
        child.join()
        out, err = (Path(folder, name).read_text() for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess(["-c", script, *args], child.exitcode, out, err)


def _run_script(script: str, args: list[str], folder: str) -> None:
    """In the forked child: the script as `python -c` would run it, its stdout and stderr into files."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(Path(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["-c", *args]
    exec(compile(script, "<route>", "exec"), {"__name__": "__main__"})


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
