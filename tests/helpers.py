"""What the tests share besides fixtures: tiny datasets, the CLI drivers (in this process or a fresh
one), the 2-process job runner, readers of a run's outputs, and the image-text tests' rows, images,
micro-batches and adapted models."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from lora_tune.cli import main
from lora_tune.config import TrainConfig
from lora_tune.data.batching import collate
from lora_tune.data.prepare import Sample
from lora_tune.data.tokenize import Tokenize
from lora_tune.models.head import IGNORE
from lora_tune.models.loading import load_config, load_tokenizer
from lora_tune.models.processors import load_image_text

ROOT = Path(__file__).resolve().parent.parent  # the repository: presets, notebooks, README, benchmarks


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ALPACA = [
    {"instruction": f"Add {a} and {a + 1}.", "input": "" if a % 2 else "numbers", "output": f"The answer is {2 * a + 1}."}
    for a in range(12)
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {a} plus 1?"},
            {"role": "assistant", "content": f"It is {a + 1}."},
        ]
    }
    for a in range(12)
]
PROMPT_COMPLETION = [{"prompt": f"Count to {a}:", "completion": " " + " ".join(str(i) for i in range(a))} for a in range(1, 13)]
TEXT = [{"text": f"The quick brown fox number {a} jumps over the lazy dog."} for a in range(12)]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `lora-tune ARGS` in this process (fast: no re-import of torch per call)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_subprocess(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed console entry point in a fresh interpreter (signals, kills, real exit codes)."""
    return subprocess.run([sys.executable, "-m", "lora_tune", *map(str, args)], capture_output=True, text=True, timeout=timeout, **kwargs)


# A few steps of fp32 training on the tiny model: the options of fast_train_args (flags) and of the API.
FAST = {"precision": "fp32", "rank": 4, "lr": 5e-3, "max_steps": 4, "micro_batch_size": 2, "max_seq_len": 128, "optim": "adamw", "seed": 7}


def fast_train_args(base: Path, data: Path, out: Path, **overrides) -> list[str]:
    """`train` argv for a few steps of fp32 training on the tiny model; overrides use flag names without dashes."""
    opts = {**FAST, **overrides}
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


# LoRA+ (tests/engines/test_common.py, test_sharded_runs.py): one step from B = 0 (no clipping: the
# same gradients scale the same way in a LoRA+ run and a plain one).
LORAPLUS_RATIO, LORAPLUS_LR = 4.0, 1e-3
LORAPLUS_RUN = dict(max_steps=1, lr=LORAPLUS_LR, max_grad_norm=0, micro_batch_size=2, optim="adamw", dropout=0.0)


def assert_loraplus_first_step(plus: dict, plain: dict) -> None:
    """`plus` (LoRA+ at LORAPLUS_RATIO) and `plain`: one AdamW step from the same start and gradients."""
    assert plus.keys() == plain.keys()
    b_keys = [k for k in plus if "lora_B" in k]
    assert b_keys and all(torch.equal(plus[k], plain[k]) for k in plus if "lora_A" in k)
    for k in b_keys:
        torch.testing.assert_close(plus[k], LORAPLUS_RATIO * plain[k], rtol=1e-5, atol=0)
    b = torch.cat([plus[k].flatten() for k in b_keys]).abs()
    moved_by_r_lr = ((b - LORAPLUS_RATIO * LORAPLUS_LR).abs() <= 1e-4 * LORAPLUS_RATIO * LORAPLUS_LR).float().mean()
    assert moved_by_r_lr > 0.9  # the tiny model's few tokens leave some gradients near eps


def single_error_line(err: str) -> str:
    """The stderr of a refused command: exactly one line, starting with 'error:', no traceback."""
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(jobs: list[dict], folder: Path, nproc: int = 2, timeout: float = 900, nodes: int = 1) -> list[dict]:
    """Run CLI jobs one after another inside one `nproc`-process job (see distributed_jobs.py).
    `nodes` > 1: that many torchrun "nodes" of `nproc` ranks each, over loopback, the README's
    multi-node command (one torchrun per node, --node-rank, node 0 as the master)."""
    jobs_file = folder / "jobs.json"
    jobs_file.write_text(json.dumps(jobs, default=str))
    port = free_port()
    (folder / "master_port").write_text(str(port))  # for tests that look at what the job left behind
    worker = Path(__file__).resolve().parent / "distributed_jobs.py"
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1"]
    launch.append(f"--master_port={port}")
    per_node = [[*launch, f"--nnodes={nodes}", f"--node_rank={n}"] if nodes > 1 else launch for n in range(nodes)]
    env = {**os.environ, "LOCAL_SIZE": str(nproc)}
    procs = [
        subprocess.Popen([*cmd, str(worker), str(jobs_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for cmd in per_node
    ]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    results = Path(str(jobs_file) + ".results")
    assert all(p.returncode == 0 for p in procs) and results.is_file(), "\n".join(err[-4000:] for _, err in outputs)
    return json.loads(results.read_text())


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def start(args: list) -> subprocess.Popen:
    """`lora-tune ARGS` in a child process, to be signalled or killed; its stderr kept."""
    return subprocess.Popen(
        [sys.executable, "-m", "lora_tune", *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def metrics_lines(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, timeout: float = 300) -> None:
    """Until the run has logged `steps` metrics lines (or ended, or the time is up)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and metrics_lines(out) < steps:
        time.sleep(0.02)


# --- the data stage -------------------------------------------------------------------------------
def data_config(data="x.jsonl", **kw):
    return TrainConfig(base="tiny-llama", data=data if isinstance(data, list) else str(data), output_dir="out", **kw)


def tokenize_rows(tokenizer, fmt: str, records: list[dict], **options) -> list[tuple[Sample, int]]:
    """Records through the tokenizing map function as one batch: (sample, status) each."""
    out = Tokenize(tokenizer, fmt, data_config(**options), "d.jsonl")(
        {k: [r[k] for r in records] for k in records[0]}, list(range(len(records)))
    )
    return [(Sample(*(out[k][i] for k in ("input_ids", "labels", "starts", "label"))), out["status"][i]) for i in range(len(records))]


def tokenize_one(tokenizer, fmt: str, record: dict, **options) -> tuple[Sample, int]:
    """One record through the tokenizing map function: (sample, status)."""
    return tokenize_rows(tokenizer, fmt, [record], **options)[0]


def trained_spans(tokenizer, sample: Sample) -> list[str]:
    spans, current = [], []
    for t in sample.labels + [IGNORE]:
        if t == IGNORE:
            if current:
                spans.append(tokenizer.decode(current))
            current = []
        else:
            current.append(t)
    return spans


# --- faults the machine can make: a small or read-only disk ------------------------------------------
@contextlib.contextmanager
def tmpfs(path: Path, size: str = "4m", read_only: bool = False, fill=None):
    """A tmpfs mounted at `path` (skips the test where mounting needs a root we don't have); with
    `fill(path)` run before it is remounted read-only. Unmounted at the end."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); needs root")
    try:
        if fill:
            fill(path)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)
        yield path
    finally:
        gc.collect()  # drop any file handle a failed run's objects still hold
        subprocess.run(["umount", str(path)], check=False, capture_output=True)
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def tree_digest(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, str]:
    """Every entry under `root` (but those under `skip`): a file by its bytes' hash and mode, a link
    by its target (never followed), a folder by its mode. Equal digests: not a byte changed."""
    skip = tuple(p.resolve() if not p.is_symlink() else p for p in skip)
    digest = {}
    for path in sorted(root.rglob("*")):
        if any(path == s or s in path.parents for s in skip):
            continue
        rel = str(path.relative_to(root))
        if path.is_symlink():
            digest[rel] = f"link -> {os.readlink(path)}"
        elif path.is_dir():
            digest[rel] = f"dir {oct(path.stat().st_mode)}"
        else:
            digest[rel] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {oct(path.stat().st_mode)}"
    return digest


def adapted_tiny_model(path: Path):
    """The tiny model in fp32 with an r4 adapter on q/v whose B is not zero (so it changes the model),
    seeded: the objectives' tests compare losses and gradients against TRL's on it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


# --- image-text: rows asking for an image's colour, the images, micro-batches, adapted models --------
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}
LANGUAGE_QV = r".*language_model.*\.(q_proj|v_proj)"  # peft targets: the language model's q/v projections alone


def row(colour: str, image: str | None = None) -> dict:
    """A chat row asking what colour `image` (a path; none: the question alone) is, answered `colour`."""
    user = [{"type": "text", "text": "What colour is this?"}]
    if image:
        user.insert(0, {"type": "image", "image": image})
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"It is {colour}."}]}


def colour_images(root: Path) -> None:
    """root/img/NAME.png, 64x48 in each of COLOURS, and root/img/other-NAME.png, 48x64 in its complement."""
    (root / "img").mkdir()
    for name, colour in COLOURS.items():
        Image.new("RGB", (64, 48), colour).save(root / "img" / f"{name}.png")
        Image.new("RGB", (48, 64), tuple(255 - c for c in colour)).save(root / "img" / f"other-{name}.png")


def load_image_text_of(base: Path):
    return load_image_text(str(base), load_config(str(base), False), data_config())


def samples_of(base: Path, folder: Path, rows: list[dict]):
    """The rows through the tokenizing map function with the base's processor (images relative to
    `folder`): (samples, the processor's ImageText)."""
    image_text = load_image_text_of(base)
    assert not isinstance(image_text, str), image_text
    out = Tokenize(load_tokenizer(str(base), False), "messages", data_config(), "d.jsonl", image_text=image_text, folder=folder)(
        {"messages": [r["messages"] for r in rows]}, list(range(len(rows)))
    )
    samples = [Sample(out["input_ids"][i], out["labels"][i], out["starts"][i], images=out["images"][i]) for i in range(len(rows))]
    return samples, image_text


def micro_batch(base: Path, folder: Path, rows: list[dict]):
    """The rows as lora-tune collates them (images, blank image where none), and as text alone."""
    samples, image_text = samples_of(base, folder, rows)
    return collate([[s] for s in samples], 0, packed=False, image_text=image_text), collate([[s] for s in samples], 0, packed=False)


def adapted_image_text_model(base: Path, targets):
    """The image-text model in fp32 with an r4 adapter on `targets` (peft's target_modules) whose B is
    not zero, seeded."""
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


def lora_grads(model) -> dict[str, torch.Tensor]:
    """The gradients the backward left (the trainable tensors'), cloned; the model's zeroed."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads
