"""Helpers for Jupyter and Colab: samples as the model sees them, and a live training plot.

from lora_tune.notebook import LivePlot, show_samples
show_samples("my_data.jsonl", base="llama-8b")          # prompt tokens greyed out, trained ones green
plot = LivePlot()
lora_tune.train(..., callback=plot)                      # loss, tokens/s and memory, redrawn each step
"""

from __future__ import annotations

import html
from functools import partial
from pathlib import Path

from lora_tune.after import reporting
from lora_tune.config import TrainConfig
from lora_tune.data.prepare import prepare_data
from lora_tune.models.aliases import resolve_base
from lora_tune.models.head import IGNORE
from lora_tune.models.loading import load_config, load_tokenizer
from lora_tune.models.processors import load_image_text
from lora_tune.training.objectives import registry as objectives


def in_notebook() -> bool:
    try:
        from IPython import get_ipython  # noqa: PLC0415 - optional dependency: present inside a notebook

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except ImportError:
        return False


SEQUENCE_NAMES = {"pairs": ("chosen", "rejected"), "unpaired": ("completion", "KL sequence (the previous row's answer)")}


def show_samples(data, base: str, n: int = 3, max_seq_len: int = 2048, **options) -> list[str]:
    """The first `n` training samples as token pieces: masked (no loss) in grey, trained in green,
    exactly as `train` would build them from the same options. Returns the HTML (also displayed)."""
    cfg = TrainConfig(
        base=base, data=data if isinstance(data, list) else str(data), output_dir="unused", max_seq_len=max_seq_len, **options
    )
    base_path = resolve_base(base)
    tokenizer = load_tokenizer(base_path, cfg.trust_remote_code)
    image_text = load_image_text(base_path, load_config(base_path, cfg.trust_remote_code), cfg)  # image rows: their image tokens
    prepared = prepare_data(cfg, tokenizer, partial(objectives.data_refusal, objectives.of(cfg)), image_text)
    names = SEQUENCE_NAMES.get(objectives.of(cfg).data, ())
    pages = []
    for i in range(min(n, len(prepared.train))):
        sample = prepared.train[i]
        spans = []
        for k, (token, label) in enumerate(zip(sample.input_ids, sample.labels)):
            if k in sample.starts and names:  # a pair's (or KTO row's) sequences, each under its name
                spans.append(f"{'<br>' if k else ''}<i>{names[sample.starts.index(k)]}:</i> ")
            text = html.escape(tokenizer.decode([token])).replace("\n", "↵<br>")
            style = "color:#999" if label == IGNORE else "color:#0a7d2c;font-weight:bold"
            spans.append(f'<span style="{style}">{text}</span>')
        trained = sum(label != IGNORE for label in sample.labels)
        pages.append(
            f"<div style='font-family:monospace;border:1px solid #ddd;padding:6px;margin:4px'><b>sample {i}</b> "
            f"({len(sample.input_ids)} tokens, {trained} with a loss)<br>{''.join(spans)}</div>"
        )
    legend = (
        "<p><span style='color:#999'>grey: no loss (prompt)</span> · <span style='color:#0a7d2c;font-weight:bold'>green: trained</span></p>"
    )
    if in_notebook():
        from IPython.display import HTML, display  # noqa: PLC0415 - optional dependency: present inside a notebook

        display(HTML(legend + "".join(pages)))
    return pages


class LivePlot:
    """A `callback` for `lora_tune.train`: loss (and eval loss), tokens/s and peak memory, redrawn
    in place after every logged step; `save(path)` writes the last figure."""

    PANELS = ("loss", "tokens_per_s", "peak_memory_bytes")

    def __init__(self, every: int = 1):
        self.every = every
        self.rows: list[dict] = []
        self.handle = None
        self.figure = None

    def __call__(self, record: dict) -> None:
        if "loss" in record or "eval_loss" in record:
            self.rows.append(record)
        if "loss" in record and sum("loss" in r for r in self.rows) % self.every == 0:
            self.draw()

    def draw(self):
        plt = reporting.pyplot(headless=not in_notebook())
        rewards = reporting.has_rewards(self.rows)  # a preference or online RL run: its rewards get a panel
        if self.figure is None:
            self.figure, self.axes = plt.subplots(1, len(self.PANELS) + rewards, figsize=(13 + 4 * rewards, 3.2))
            plt.close(self.figure)  # shown through display(), not twice
        reporting.draw(dict(zip(self.PANELS, self.axes)), self.rows)
        if rewards:
            for extra in self.figure.axes[len(self.axes) :]:  # the twin axis drawn with the rewards last time
                extra.remove()
            reporting.draw_rewards(self.axes[-1], self.rows)
        self.figure.tight_layout()
        if in_notebook():
            from IPython.display import display  # noqa: PLC0415 - optional dependency: present inside a notebook

            if self.handle is None:
                self.handle = display(self.figure, display_id=True)
            else:
                self.handle.update(self.figure)
        return self.figure

    def save(self, path: str | Path) -> Path:
        self.draw().savefig(path, dpi=100)
        return Path(path)
