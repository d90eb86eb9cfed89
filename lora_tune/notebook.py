"""Helpers for Jupyter and Colab: samples as the model sees them, and a live training plot.

    from lora_tune.notebook import LivePlot, show_samples
    show_samples("my_data.jsonl", base="llama-8b")          # prompt tokens greyed out, trained ones green
    plot = LivePlot()
    lora_tune.train(..., callback=plot)                      # loss, tokens/s and memory, redrawn each step
"""

from __future__ import annotations

import html
from pathlib import Path


def in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except ImportError:
        return False


def show_samples(data, base: str, n: int = 3, max_seq_len: int = 2048, **options) -> list[str]:
    """The first `n` training samples as token pieces: masked (no loss) in grey, trained in green,
    exactly as `train` would build them from the same options. Returns the HTML (also displayed)."""
    from lora_tune.aliases import resolve_base
    from lora_tune.config import TrainConfig
    from lora_tune.data import IGNORE, prepare_data
    from lora_tune.model_loading import load_tokenizer

    cfg = TrainConfig(base=base, data=data if isinstance(data, list) else str(data), output_dir="unused", max_seq_len=max_seq_len, **options)
    tokenizer = load_tokenizer(resolve_base(base), cfg.trust_remote_code)
    prepared = prepare_data(cfg, tokenizer)
    pages = []
    for i in range(min(n, len(prepared.train))):
        sample = prepared.train[i]
        spans = []
        for token, label in zip(sample.input_ids, sample.labels):
            text = html.escape(tokenizer.decode([token])).replace("\n", "↵<br>")
            style = "color:#999" if label == IGNORE else "color:#0a7d2c;font-weight:bold"
            spans.append(f'<span style="{style}">{text}</span>')
        trained = sum(label != IGNORE for label in sample.labels)
        pages.append(f"<div style='font-family:monospace;border:1px solid #ddd;padding:6px;margin:4px'><b>sample {i}</b> "
                     f"({len(sample.input_ids)} tokens, {trained} with a loss)<br>{''.join(spans)}</div>")
    legend = "<p><span style='color:#999'>grey: no loss (prompt)</span> · <span style='color:#0a7d2c;font-weight:bold'>green: trained</span></p>"
    if in_notebook():
        from IPython.display import HTML, display

        display(HTML(legend + "".join(pages)))
    return pages


class LivePlot:
    """A `callback` for `lora_tune.train`: loss (and eval loss), tokens/s and peak memory, redrawn
    in place after every logged step; `save(path)` writes the last figure."""

    def __init__(self, every: int = 1):
        self.every = every
        self.steps: list[dict] = []
        self.evals: list[dict] = []
        self.handle = None
        self.figure = None

    def __call__(self, record: dict) -> None:
        if "eval_loss" in record:
            self.evals.append(record)
        elif "loss" in record:
            self.steps.append(record)
            if len(self.steps) % self.every == 0:
                self.draw()

    def draw(self):
        import matplotlib

        if not in_notebook():
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if self.figure is None:
            self.figure, self.axes = plt.subplots(1, 3, figsize=(13, 3.2))
            plt.close(self.figure)  # shown through display(), not twice
        number = lambda v: float(v) if isinstance(v, (int, float)) else float("nan")  # noqa: E731
        x = [r["step"] for r in self.steps]
        loss, speed, memory = self.axes
        for ax in self.axes:
            ax.clear()
            ax.grid(alpha=0.3)
            ax.set_xlabel("step")
        loss.plot(x, [number(r["loss"]) for r in self.steps], label="train")
        if self.evals:
            loss.plot([r["step"] for r in self.evals], [number(r["eval_loss"]) for r in self.evals], "o-", label="eval")
        loss.set_title("loss")
        loss.legend()
        speed.plot(x, [number(r["tokens_per_s"]) for r in self.steps])
        speed.set_title("tokens / s")
        memory.plot(x, [number(r["peak_memory_bytes"]) / 2**30 for r in self.steps])
        memory.set_title("peak memory (GiB)")
        self.figure.tight_layout()
        if in_notebook():
            from IPython.display import display

            if self.handle is None:
                self.handle = display(self.figure, display_id=True)
            else:
                self.handle.update(self.figure)
        return self.figure

    def save(self, path: str | Path) -> Path:
        self.draw().savefig(path, dpi=100)
        return Path(path)
