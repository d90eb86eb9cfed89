"""Shared fixtures: a tiny Llama saved to disk (loaded through the real from_pretrained path),
small datasets in each format, and a helper that drives the real CLI entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tokenized data is cached under the datasets cache: keep the suite's out of the user's.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="lora-tune-tests-datasets-"))


def pytest_configure(config):
    # datasets gives its logger a handler bound to whatever sys.stderr is the first time it logs;
    # if that happens inside a test's capsys, later tests log into a closed stream ("--- Logging
    # error ---" in their stderr). Bind it now, to the session's stream.
    import datasets.utils.logging

    datasets.utils.logging.get_logger("datasets")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from lora_tune.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_no_template(tmp_path_factory) -> Path:
    from lora_tune.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-nochat"), with_chat_template=False)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ALPACA = [{"instruction": f"Add {a} and {a + 1}.", "input": "" if a % 2 else "numbers", "output": f"The answer is {2 * a + 1}."} for a in range(12)]
CHAT = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {a} plus 1?"}, {"role": "assistant", "content": f"It is {a + 1}."}]} for a in range(12)]
PROMPT_COMPLETION = [{"prompt": f"Count to {a}:", "completion": " " + " ".join(str(i) for i in range(a))} for a in range(1, 13)]
TEXT = [{"text": f"The quick brown fox number {a} jumps over the lazy dog."} for a in range(12)]


@pytest.fixture
def data_files(tmp_path) -> dict[str, Path]:
    return {
        "alpaca": write_jsonl(tmp_path / "alpaca.jsonl", ALPACA),
        "messages": write_jsonl(tmp_path / "chat.jsonl", CHAT),
        "prompt_completion": write_jsonl(tmp_path / "pc.jsonl", PROMPT_COMPLETION),
        "text": write_jsonl(tmp_path / "text.jsonl", TEXT),
    }


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `lora-tune ARGS` in this process (fast: no re-import of torch per call)."""
    from lora_tune.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_subprocess(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed console entry point in a fresh interpreter (signals, kills, real exit codes)."""
    return subprocess.run([sys.executable, "-m", "lora_tune", *map(str, args)], capture_output=True, text=True, timeout=timeout, **kwargs)


def fast_train_args(base: Path, data: Path, out: Path, **overrides) -> list[str]:
    """A few steps of fp32 training on the tiny model; overrides use flag names without dashes."""
    opts = {"precision": "fp32", "rank": 4, "lr": 5e-3, "max_steps": 4, "micro_batch_size": 2, "max_seq_len": 128, "optim": "adamw", "seed": 7}
    opts.update(overrides)
    args = ["train", "--base", base, "--data", *(data if isinstance(data, list) else [data]), "--output-dir", out]
    for k, v in opts.items():
        name = "--" + k.replace("_", "-")
        if v is True:
            args.append(name)
        elif v is False:
            args.append("--no-" + k.replace("_", "-"))
        elif isinstance(v, list):
            args += [name, *v]
        else:
            args += [name, v]
    return args


def single_error_line(err: str) -> str:
    """The stderr of a refused command: exactly one line, starting with 'error:', no traceback."""
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def run_jobs(jobs: list[dict], folder: Path, nproc: int = 2, timeout: float = 900) -> list[dict]:
    """Run CLI jobs one after another inside one `nproc`-process job (see distributed_jobs.py)."""
    import socket

    jobs_file = folder / "jobs.json"
    jobs_file.write_text(json.dumps(jobs, default=str))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (folder / "master_port").write_text(str(port))  # for tests that look at what the job left behind
    worker = Path(__file__).resolve().parent / "distributed_jobs.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}", str(worker), str(jobs_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "LOCAL_SIZE": str(nproc)})
    results = Path(str(jobs_file) + ".results")
    assert proc.returncode == 0 and results.is_file(), proc.stderr[-4000:]
    return json.loads(results.read_text())
