"""`lora-tune report OUTPUT_DIR`: the run's curves as a PNG (loss and eval loss, learning rate,
tokens/s, peak memory over steps, from metrics.jsonl) and a short text summary. matplotlib is an
optional extra (`pip install "lora-tune[report]"`)."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from lora_tune.after.evaluation import read_results, table
from lora_tune.after.outputs import check_output
from lora_tune.errors import UserError, first_line
from lora_tune.training.metrics import read_records


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl; lines that are not records (a line torn by a killed
    process, garbage) are skipped, and said."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"report: {run_dir} has no metrics.jsonl; point it at a folder written by `lora-tune train`")
    try:
        rows, bad = read_records(path)
    except OSError as e:
        raise UserError(f"report: {path} is unreadable ({e.strerror or e})") from None
    if bad:
        lines = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        print(f"note: skipped {len(bad)} unreadable line(s) of {path} (line {lines})")
    if not any("loss" in r for r in rows):
        unreadable = f" ({len(bad)} unreadable line(s) skipped)" if bad else ""
        raise UserError(f"report: {path} holds no training steps yet{unreadable}")
    return rows


def number(v) -> float:
    if isinstance(v, bool):
        return math.nan
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)  # "nan"/"inf" are logged as strings
    except (TypeError, ValueError):
        return math.nan


def throughput(steps: list[dict]) -> str:
    """Tokens over time, as everyone reads "tokens/s": the logged steps' tokens over their seconds (a
    mean of per-step rates would let one fast step stand for many slow ones)."""
    timed = [(number(r.get("tokens_per_s")), number(r.get("step_seconds"))) for r in steps]
    timed = [(rate * seconds, seconds) for rate, seconds in timed if math.isfinite(rate) and math.isfinite(seconds) and seconds > 0]
    seconds = sum(s for _, s in timed)
    if not seconds:
        return "tokens/s unknown (no step times in metrics.jsonl)"
    done = sum(t for t, _ in timed)
    return f"{done / seconds:,.0f} tokens/s ({done:,.0f} tokens in {seconds:,.1f} s of training steps)"


def summary(rows: list[dict]) -> str:
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    peaks = [v for v in (number(r.get("peak_memory_bytes")) for r in steps) if math.isfinite(v)] or [math.nan]
    tokens = number(steps[-1].get("tokens_seen", 0))
    lines = [
        f"steps: {steps[-1].get('step')}; loss {number(steps[0]['loss']):.4f} -> {number(steps[-1]['loss']):.4f}",
        f"tokens: {tokens:,.0f}; {throughput(steps)}; peak memory {max(peaks) / 2**30:.2f} GiB",
    ]
    if evals:
        best = min(evals, key=lambda r: number(r["eval_loss"]) if math.isfinite(number(r["eval_loss"])) else math.inf)
        ppl = f" (perplexity {number(evals[-1].get('eval_ppl')):.2f})" if "eval_ppl" in evals[-1] else ""
        last = number(evals[-1]["eval_loss"])
        lines.append(f"eval loss: last {last:.4f}{ppl}; best {number(best['eval_loss']):.4f} at step {best.get('step')}")
    if ONLINE_REWARD in steps[-1]:  # online RL (GRPO)
        lines.append(
            f"reward: {number(steps[0][ONLINE_REWARD]):.3f} -> {number(steps[-1][ONLINE_REWARD]):.3f}; completions "
            f"{number(steps[-1].get(LENGTH)):.1f} tokens on average (clipped {number(steps[-1].get('completions/clipped_ratio')):.0%})"
        )
    if REWARDS in steps[-1]:  # a preference objective
        held_out = f" (eval {number(evals[-1]['eval_' + REWARDS]):.3f})" if evals and "eval_" + REWARDS in evals[-1] else ""
        lines.append(
            f"rewards: accuracy last {number(steps[-1][REWARDS]):.3f}{held_out}; margin {number(steps[-1].get('rewards/margins')):.3f}"
        )
    skipped = sum(1 for r in steps if r.get("skipped") is True)
    if skipped:
        lines.append(f"skipped steps (NaN/inf): {skipped}")
    samples = [r for r in rows if sample_of(r)]
    if samples:
        s = sample_of(samples[-1])
        lines.append(f"last sample (step {samples[-1].get('step')}): {s['prompt'][-60:]!r} -> {s['completion'][:160]!r}")
    return "\n".join(lines)


def sample_of(record: dict) -> dict | None:
    """The first sample generation of a record, when it has one of the shape train writes."""
    samples = record.get("samples")
    first = samples[0] if isinstance(samples, list) and samples else None
    ok = isinstance(first, dict) and all(isinstance(first.get(k), str) for k in ("prompt", "completion"))
    return first if ok else None


REWARDS = "rewards/accuracies"  # logged by the preference objectives (TRL's name)
ONLINE_REWARD, LENGTH = "reward", "completions/mean_length"  # logged by GRPO (TRL's names)
PANELS = {
    "loss": ("loss", 1),
    "lr": ("learning rate", 1),
    "tokens_per_s": ("tokens / s", 1),
    "peak_memory_bytes": ("peak memory (GiB)", 2**30),
}


def pyplot(headless: bool = True):
    """matplotlib's pyplot (an optional extra; `headless`: drawing to files only), or the one-line
    error that says how to get it."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency: the [report] extra

        if headless:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency, after choosing the backend
    except ImportError:
        raise UserError('report: the plot needs matplotlib; pip install matplotlib (or "lora-tune[report]")') from None
    return plt


def draw(axes: dict, rows: list[dict]) -> None:
    """Each named panel (a key of PANELS) of the metrics records onto its matplotlib axes; the loss
    panel also shows the eval loss."""
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    x = [number(r.get("step")) for r in steps]
    for key, ax in axes.items():
        title, scale = PANELS[key]
        ax.clear()
        ax.plot(x, [number(r.get(key)) / scale for r in steps], label="train loss" if key == "loss" else None)
        if key == "loss" and evals:
            ax.plot([number(r.get("step")) for r in evals], [number(r["eval_loss"]) for r in evals], "o-", label="eval loss")
        if key == "loss":
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)


def has_rewards(rows: list[dict]) -> bool:
    """A preference run (reward accuracy) or an online RL run (reward): the rewards get a panel."""
    return any(REWARDS in r or ONLINE_REWARD in r for r in rows)


def draw_rewards(ax, rows: list[dict]) -> None:
    """A preference run's reward accuracy (train, and eval when measured) and margin; an online RL
    run's mean reward and completion length."""
    if any(ONLINE_REWARD in r for r in rows):
        steps = [r for r in rows if ONLINE_REWARD in r]
        x = [number(r.get("step")) for r in steps]
        ax.clear()
        ax.plot(x, [number(r[ONLINE_REWARD]) for r in steps], label="reward")
        lengths = ax.twinx()
        lengths.plot(x, [number(r.get(LENGTH)) for r in steps], color="tab:gray", alpha=0.6)
        lengths.set_ylabel("completion length (tokens)")
        ax.set_title("rewards")
        ax.set_xlabel("step")
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
        return
    steps = [r for r in rows if REWARDS in r]
    evals = [r for r in rows if "eval_" + REWARDS in r]
    ax.clear()
    ax.plot([number(r.get("step")) for r in steps], [number(r[REWARDS]) for r in steps], label="reward accuracy")
    if evals:
        ax.plot([number(r.get("step")) for r in evals], [number(r["eval_" + REWARDS]) for r in evals], "o-", label="eval reward accuracy")
    margins = ax.twinx()
    margins.plot([number(r.get("step")) for r in steps], [number(r.get("rewards/margins")) for r in steps], color="tab:gray", alpha=0.6)
    margins.set_ylabel("reward margin")
    ax.set_ylim(0, 1.05)
    ax.set_title("rewards")
    ax.set_xlabel("step")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)


def plot(rows: list[dict], png: Path, eval_results: dict | None = None) -> None:
    """The four panels of the metrics, then a column for the rewards of a preference run and the
    lm-eval scores when the run was evaluated; written to a temporary file beside `png` and renamed
    onto it: a failed write leaves nothing half-written, and a link at `png` is replaced, never
    written through."""
    plt = pyplot()
    rewards = has_rewards(rows)
    extra = bool(eval_results) or rewards
    fig, axes = plt.subplots(2, 3 if extra else 2, figsize=(16 if extra else 11, 7), squeeze=False)
    draw(dict(zip(PANELS, [ax for row in axes for ax in row[:2]])), rows)
    if extra:
        free = [axes[0][2], axes[1][2]]
        if rewards:
            draw_rewards(free.pop(0), rows)
        if eval_results:
            plot_eval_results(free.pop(0), eval_results)
        for ax in free:
            ax.axis("off")
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=100, format=png.suffix[1:].lower())
        os.replace(tmp, png)
    except OSError as e:
        raise UserError(f"report: could not write {png} ({e.strerror or e})") from None
    except ValueError as e:  # a kind of file matplotlib does not write
        raise UserError(f"report: --output {png}: {first_line(e)}; use .png, .pdf or .svg") from None
    finally:
        plt.close(fig)
        with contextlib.suppress(OSError):  # e.g. a read-only folder, where nothing was written
            tmp.unlink(missing_ok=True)


def check_plot_file(png: Path) -> Path:
    """A plot file report may write (`outputs.check_output`: never through a link, never into a
    checkpoint or a model, in a run's folder replacing only a plot), in an existing folder, of a
    kind matplotlib writes."""
    png = check_output(png, "report", folder=False, replaces=True, ours=is_plot, said=f"report: --output {png}")
    if not png.parent.is_dir():
        raise UserError(f"report: --output {png}: the folder {png.parent} does not exist")
    if not png.suffix:
        raise UserError(f"report: --output {png}: give a file name with its kind, such as report.png or report.pdf")
    return png


def is_plot(path: Path) -> bool:
    """A file of a kind matplotlib writes (the only kind report replaces in a run's folder)."""
    from matplotlib.backend_bases import FigureCanvasBase  # noqa: PLC0415 - optional dependency: the [report] extra

    return path.suffix[1:].lower() in FigureCanvasBase.get_supported_filetypes()


def plot_eval_results(ax, record: dict) -> None:
    """lm-eval scores from `lora-tune eval` (eval_results.json): base and adapter bars per task metric."""
    tuned = record.get("adapter") or record.get("model") or {}
    base = record.get("base") or {}
    labels, tuned_values, base_values = [], [], []
    for task, row in tuned.items():
        for metric, value in row.items():
            if metric.endswith("_stderr") or metric == "sample_len":
                continue
            labels.append(f"{task}\n{metric}")
            tuned_values.append(value)
            base_values.append(base.get(task, {}).get(metric, math.nan))
    x = range(len(labels))
    width = 0.4 if base else 0.8
    if base:
        ax.bar([i - width / 2 for i in x], base_values, width, label="base")
    ax.bar([i + (width / 2 if base else 0) for i in x], tuned_values, width, label="adapter" if "adapter" in record else "model")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_title("lm-eval" + (f" (limit {record['limit']:g})" if record.get("limit") else ""))
    ax.legend()


def run(cfg) -> Path:
    run_dir = Path(cfg.run_dir).expanduser()
    rows = read_metrics(run_dir)
    pyplot()  # the one-line error when matplotlib is missing, before anything else is said
    png = check_plot_file(Path(cfg.output) if cfg.output else run_dir / "report.png")
    eval_results = None
    if (run_dir / "eval_results.json").is_file():
        eval_results = read_results(run_dir)
    plot(rows, png, eval_results)
    print(summary(rows))
    if eval_results:
        print(table(eval_results))
    print(f"plot: {png}")
    return png
