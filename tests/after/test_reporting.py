"""`lora-tune report`: a summary and a plot from metrics records; a live plot draws the same panels."""

from __future__ import annotations

import json
import os

import pytest

from lora_tune.after.options import ReportConfig
from lora_tune.after.reporting import run, summary
from lora_tune.errors import UserError
from lora_tune.notebook import LivePlot

from helpers import run_cli, single_error_line, tmpfs, tree_digest

ROWS = [  # 100 tokens a step, in 1 s, 1/3 s and 1/5 s
    {"step": 1, "loss": 3.0, "lr": 1e-4, "tokens_per_s": 100.0, "peak_memory_bytes": 2**30, "tokens_seen": 100, "step_seconds": 1.0},
    {
        "step": 2,
        "loss": "nan",
        "lr": 2e-4,
        "tokens_per_s": 300.0,
        "peak_memory_bytes": 2**31,
        "tokens_seen": 200,
        "step_seconds": 1 / 3,
        "skipped": True,
    },
    {"step": 2, "eval_loss": 2.5, "eval_ppl": 12.18},
    {"step": 3, "loss": 2.0, "lr": 2e-4, "tokens_per_s": 500.0, "peak_memory_bytes": 2**31, "tokens_seen": 300, "step_seconds": 0.2},
]


def test_summary_states_the_run_in_numbers():
    text = summary(ROWS)
    assert "steps: 3; loss 3.0000 -> 2.0000" in text and "peak memory 2.00 GiB" in text
    assert "196 tokens/s (300 tokens in 1.5 s of training steps)" in text  # 300 / (1 + 1/3 + 1/5)
    assert "eval loss: last 2.5000 (perplexity 12.18); best 2.5000 at step 2" in text and "skipped steps (NaN/inf): 1" in text


def test_throughput_is_tokens_over_time_not_a_mean_of_rates():
    """The issue's run: steps at 44, 44 and 3,792 tokens/s were reported as 1,918 tokens/s (the mean of
    the last two rates); 360 tokens in about 5.5 s is 66."""
    rows = [{"step": i + 1, "loss": 1.0, "tokens_per_s": rate, "step_seconds": 120 / rate} for i, rate in enumerate((44.0, 44.0, 3792.0))]
    assert "tokens: 0; 66 tokens/s (360 tokens in 5.5 s of training steps)" in summary(rows)
    assert "tokens/s unknown (no step times in metrics.jsonl)" in summary([{"step": 1, "loss": 1.0, "tokens_per_s": 50.0}])


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


ODD_LINES = {
    "torn last line": '{"step": 4, "loss": 1.9, "lr',
    "binary garbage": "\x00\x9f\x92\x96 garbage",
    "a list": "[1, 2, 3]",
    "a string step": '{"step": "four", "loss": 1.0}',
    "a text loss": '{"step": 4, "loss": "abc", "tokens_per_s": "fast", "peak_memory_bytes": null}',
    "no speed nor memory": '{"step": 4, "loss": 1.5}',
    "odd samples": '{"step": 4, "samples": [{"prompt": 3}]}',
    "odd eval": '{"step": 4, "eval_loss": "x"}',
}


@pytest.mark.parametrize("odd", list(ODD_LINES))
def test_report_skips_or_tolerates_odd_metrics_lines(odd, tmp_path, capsys):
    lines = [json.dumps(r) for r in ROWS] + [ODD_LINES[odd]]
    (tmp_path / "metrics.jsonl").write_bytes("\n".join(lines).encode("utf-8", errors="surrogateescape"))
    code, out, err = run_cli(["report", tmp_path], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "steps: " in out and (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_report_of_only_garbage_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_bytes(os.urandom(3000))
    code, _, err = run_cli(["report", tmp_path], capsys)
    assert code == 2 and "holds no training steps yet" in single_error_line(err)


@pytest.mark.parametrize("where", ["a folder", "a missing folder", "an unknown kind", "a link", "under a file"])
def test_a_bad_report_output_is_one_line_and_writes_nothing(where, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "link.png").symlink_to(tmp_path / "notes.txt")
    output = {
        "a folder": tmp_path,
        "a missing folder": tmp_path / "nope" / "r.png",
        "an unknown kind": tmp_path / "r.xyz",
        "a link": tmp_path / "link.png",
        "under a file": tmp_path / "notes.txt" / "r.png",
    }[where]
    before = tree_digest(tmp_path)
    code, _, err = run_cli(["report", run_dir, "--output", output], capsys)
    assert code == 2 and single_error_line(err).startswith("error: report: --output ")
    assert tree_digest(tmp_path) == before


def test_a_read_only_run_folder_is_one_line(tmp_path, capsys):
    def fill(disk):
        (disk / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    with tmpfs(tmp_path / "ro", size="1m", read_only=True, fill=fill) as disk:
        code, _, err = run_cli(["report", disk], capsys)
    assert code == 2 and "could not write" in single_error_line(err) and "Read-only file system" in err
