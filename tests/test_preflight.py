"""`lora-tune train`'s front door (lora_tune.preflight): each room's check runs before the data is
tokenized and the weights are loaded, and the checked inputs are what the recipe gets."""

from __future__ import annotations

import torch

import lora_tune.config
import lora_tune.preflight
from lora_tune.data.batching import PASS_TOKENS

from families import build_family
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


def test_a_cpu_runs_large_micro_batches_in_passes_of_whole_rows():
    """One process on a CPU: a micro-batch of more than PASS_TOKENS padded tokens runs in passes
    (lora_tune.data.batching.passes); not on a GPU, not under the sharding backends (they count
    micro-steps), not for online objectives (they build their own batches), and not when the whole
    micro-batch fits one pass."""

    def cfg(**kw):
        return lora_tune.config.TrainConfig(
            **{"base": "b", "data": "d", "output_dir": "o", "micro_batch_size": 4, "max_seq_len": 1024, **kw}
        )

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert lora_tune.preflight.pass_tokens(cfg(), cpu) == PASS_TOKENS == 1024
    assert lora_tune.preflight.pass_tokens(cfg(max_seq_len=4096), cpu) == 4096  # a row longer than the budget is a pass of its own
    assert lora_tune.preflight.pass_tokens(cfg(max_seq_len=256), cpu) is None  # 4 x 256 tokens: one pass
    assert lora_tune.preflight.pass_tokens(cfg(), gpu) is None
    assert lora_tune.preflight.pass_tokens(cfg(zero=2), cpu) is None
    assert lora_tune.preflight.pass_tokens(cfg(objective="grpo"), cpu) is None


def test_sequence_parallel_refusals_are_one_line_before_loading(tiny_model, data_files, tmp_path, capsys, monkeypatch):
    """--sequence-parallel that can't run: one `error:` line naming the option and a fix, exit 2,
    before the data stage (and so before any weight or process)."""

    def no_data_stage(*a, **k):
        raise AssertionError("--sequence-parallel must be checked before the data is tokenized")

    monkeypatch.setattr(lora_tune.preflight, "prepare_data", no_data_stage)
    data = data_files["alpaca"]
    cases = [
        (dict(sequence_parallel=2), "--sequence-parallel 2 splits rows across processes: run several (--nproc 2)"),
        (dict(sequence_parallel=2, zero=2, nproc=3), "--sequence-parallel 2 must divide the number of processes (3): use --nproc 2"),
        (dict(sequence_parallel=2, zero=2, nproc=2, objective="dpo"), "--sequence-parallel trains --objective sft for now, not dpo"),
        (dict(sequence_parallel=2, zero=2, nproc=2, loss_chunk_size=0), "--sequence-parallel needs the chunked loss"),
        (dict(sequence_parallel=3, zero=2, nproc=3), "llama has 4 attention heads, which 3 ranks can't split evenly; use a divisor of 4"),
    ]
    for i, (options, expected) in enumerate(cases):
        code, _, err = run_cli(fast_train_args(tiny_model, data, tmp_path / f"run{i}", **options), capsys)
        assert code == 2 and expected in single_error_line(err), (options, err)
        assert not (tmp_path / f"run{i}").exists()


def test_tiled_mlp_on_refuses_a_mixture_of_experts(data_files, tmp_path, capsys):
    mixtral = build_family("mixtral", tmp_path / "mixtral")
    code, _, err = run_cli(fast_train_args(mixtral, data_files["alpaca"], tmp_path / "run", tiled_mlp="on"), capsys)
    assert code == 2
    assert "--tiled-mlp on: mixtral is a mixture of experts (" in single_error_line(err) and "use --tiled-mlp off" in err
