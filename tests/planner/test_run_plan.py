"""The memory plan of the run about to start (lora_tune.planner.run_plan): a warning, or with
--strict-memory an error, when it does not fit."""

from __future__ import annotations

from helpers import fast_train_args, run_cli, single_error_line


def test_train_preflight_warns_or_refuses_when_the_plan_does_not_fit(tiny_model, data_files, tmp_path, capsys):
    huge = dict(max_seq_len=50_000_000, max_steps=1)  # planned for the worst case: full-length samples
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "strict", strict_memory=True, **huge), capsys)
    assert code == 2 and "--strict-memory" in single_error_line(err) and "lora-tune plan --auto" in err
    assert not (tmp_path / "strict").exists()
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "warn", **huge), capsys)
    assert code == 0 and "warning: the memory plan needs" in err
