"""`lora-tune report`: a summary and a plot from metrics records; a live plot draws the same panels."""

from __future__ import annotations

import json

import pytest

from lora_tune.config import ReportConfig
from lora_tune.errors import UserError
from lora_tune.notebook import LivePlot
from lora_tune.reporting import run, summary

ROWS = [
    {"step": 1, "loss": 3.0, "lr": 1e-4, "tokens_per_s": 100.0, "peak_memory_bytes": 2**30, "tokens_seen": 100},
    {"step": 2, "loss": "nan", "lr": 2e-4, "tokens_per_s": 300.0, "peak_memory_bytes": 2**31, "tokens_seen": 200, "skipped": True},
    {"step": 2, "eval_loss": 2.5, "eval_ppl": 12.18},
    {"step": 3, "loss": 2.0, "lr": 2e-4, "tokens_per_s": 500.0, "peak_memory_bytes": 2**31, "tokens_seen": 300},
]


def test_summary_states_the_run_in_numbers():
    text = summary(ROWS)
    assert "steps: 3; loss 3.0000 -> 2.0000" in text and "400 tokens/s on average" in text and "peak memory 2.00 GiB" in text
    assert "eval loss: last 2.5000 (perplexity 12.18); best 2.5000 at step 2" in text and "skipped steps (NaN/inf): 1" in text


def test_report_writes_the_png(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    png = run(ReportConfig(run_dir=str(tmp_path)))
    assert png == tmp_path / "report.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot: " in capsys.readouterr().out


def test_a_folder_without_steps_is_refused(tmp_path):
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        run(ReportConfig(run_dir=str(tmp_path)))


def test_the_live_plot_keeps_every_record_and_saves_a_figure(tmp_path):
    plot = LivePlot()
    for record in ROWS:
        plot(record)
    assert len(plot.rows) == 4
    assert plot.save(tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
