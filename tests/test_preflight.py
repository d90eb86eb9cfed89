"""`lora-tune train`'s front door (lora_tune.preflight): each room's check runs before the data is
tokenized and the weights are loaded, and the checked inputs are what the recipe gets."""

from __future__ import annotations

import lora_tune.config
import lora_tune.preflight

from helpers import fast_train_args, run_cli, single_error_line


def test_bad_eval_prompts_are_refused_before_the_data_stage(tiny_model, data_files, tmp_path, capsys, monkeypatch):
    def no_data_stage(*a, **k):
        raise AssertionError("the prompts must be checked before the data is tokenized")

    monkeypatch.setattr(lora_tune.preflight, "prepare_data", no_data_stage)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n[1]\n')
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "run", eval_prompts=prompts), capsys)
    assert code == 2 and "line 2 is a JSON list" in single_error_line(err)


def test_the_checked_inputs_carry_what_training_reads_from_other_rooms(tiny_model, data_files, tmp_path):
    """The loop prints the memory plan's table on an out-of-memory stop and scores lm-eval tasks
    through the inputs, never by importing the planner or after/ (tests/test_layering.py)."""
    cfg = lora_tune.config.TrainConfig(
        base=str(tiny_model), data=str(data_files["text"]), output_dir=str(tmp_path / "run"), precision="fp32", max_seq_len=64
    )
    inputs = lora_tune.preflight.check_inputs(cfg)
    table, advice = inputs.out_of_memory_advice
    assert "per device" in table.lower() and advice.startswith("try, in this order: ")
    assert inputs.score_tasks is None  # no --eval-tasks
    assert inputs.checkpointing.enabled and inputs.total_steps >= 1
