"""Metrics: one JSON line per logged step in OUTPUT_DIR/metrics.jsonl, optional TensorBoard / W&B,
and the progress bar. Non-finite losses are written as they are (as strings), never filtered."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from lora_tune.errors import UserError

log = logging.getLogger("lora_tune")


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated by tensors; CPU: peak resident set size of this process."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        # VmHWM is this process image's own peak; ru_maxrss carries the launcher's over fork + exec.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": visible in the log, valid JSON
    return v


def check_reporter(report_to: str) -> None:
    """Fail before loading anything when the chosen reporter isn't installed."""
    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(report_to)
    if module is None:
        return
    if importlib.util.find_spec(module) is None:
        raise UserError(f"--report-to {report_to}: the '{module}' package is not installed; pip install {module}, or use --report-to none")


def parse_record(line: str) -> dict | None:
    """One metrics line as its record, or None when it is not one: torn (a process killed while
    appending it), garbage, not an object, or a step that is not a number."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step", 0)
    return record if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def read_records(path: Path, with_lines: bool = False) -> tuple[list, list[int]]:
    """(records, numbers of the lines that are not records) of a metrics.jsonl; blank lines are
    neither. `with_lines`: records as (line, record)."""
    records, bad = [], []
    text = path.read_bytes().decode("utf-8", errors="replace")
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            record = parse_record(line)
            if record is None:
                bad.append(n)
            else:
                records.append((line, record) if with_lines else record)
    return records, bad


class MetricsLog:
    def __init__(self, output_dir: Path, report_to: str, config: dict, resume_step: int | None, callback=None, history: Path | None = None):
        """`history`: on resume, the metrics of the run the checkpoint belongs to (another folder's
        when `--resume CHECKPOINT` continues it in a new one; default: this folder's)."""
        self.callback = callback
        self.path = output_dir / "metrics.jsonl"
        history = history or self.path
        if resume_step is not None and history.is_file():
            # Lines written after the checkpoint we resume from belong to steps that will be redone; a
            # line that is not a record (torn by a kill mid-append) is dropped, and said.
            records, bad = read_records(history, with_lines=True)
            if bad:
                log.info("metrics: dropped %d unreadable line(s) of %s (line %s; torn by a killed process)", len(bad), history, bad[-1])
            self.path.write_text("".join(line + "\n" for line, r in records if r.get("step", 0) <= resume_step))
        self.file = self.path.open("a")
        self.tb = self.wandb = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional dependency (tensorboard)

            self.tb = SummaryWriter(str(output_dir / "tensorboard"))
        elif report_to == "wandb":
            import wandb  # noqa: PLC0415 - optional dependency (wandb)

            self.wandb = wandb.init(config=config, dir=str(output_dir), resume="allow")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        if self.callback:
            self.callback(dict(record))
        step = record.get("step", 0)
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        samples = record.get("samples")
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, step)
            if samples:
                self.tb.add_text("samples", "\n\n".join(f"**{s['prompt']}**\n\n{s['completion']}" for s in samples), step)
        if self.wandb:
            if samples:
                import wandb  # noqa: PLC0415 - optional dependency (wandb)

                numbers["samples"] = wandb.Table(columns=["prompt", "completion"], data=[[s["prompt"], s["completion"]] for s in samples])
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


class Progress:
    """tqdm bar over optimizer steps: loss, tokens/s, peak memory; tqdm computes the ETA."""

    def __init__(self, total: int, initial: int):
        self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, loss: float, tokens_per_s: float, peak_bytes: int) -> None:
        self.bar.set_postfix_str(f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | peak {peak_bytes / 2**30:.2f} GiB", refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        """A line on the console above the bar (the bar redraws below it)."""
        self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
