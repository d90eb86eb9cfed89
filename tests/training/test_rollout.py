"""Online RL (GRPO) end to end on the tiny model: prompts -> seeded rollouts -> rewards -> the
clipped loss; a toy reward learned, packed == padded, exact resume (also in the middle of a
generation batch), completions independent of their batch, the run's files, and bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import textwrap

import pytest
import torch

import lora_tune
from lora_tune.models.tiny.model import build_tiny_llama
from lora_tune.training.generation.transformers_generate import SeededSampling

from helpers import FAST, adapter_tensors, assert_bit_identical, read_metrics, run_cli, single_error_line, write_jsonl

PROMPTS = [{"prompt": f"Write numbers {a}:", "answer": str(a)} for a in range(8)]
CHAT_PROMPTS = [{"prompt": [{"role": "user", "content": f"Count to {a}"}], "answer": str(a)} for a in range(8)]

REWARDS = '''
def even(prompts, completions, completion_ids, answer, **kwargs):
    """The share of even token ids: a dense signal the tiny model can learn in a few steps."""
    assert len(answer) == len(completions) and all(isinstance(a, str) for a in answer)
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]

def short(prompts, completions, **kwargs):
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [-len(t) / 100 for t in text]

def broken(prompts, completions, **kwargs):
    raise ValueError("no score today")

def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)

def unscored(prompts, completions, **kwargs):
    return [None] * len(completions)
'''

GRPO = {**FAST, "objective": "grpo", "num_generations": 4, "micro_batch_size": 4, "grad_accum": 2, "max_new_tokens": 8, "max_seq_len": 64}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo")
    (folder / "rewards.py").write_text(textwrap.dedent(REWARDS))
    return {
        "prompts": write_jsonl(folder / "prompts.jsonl", PROMPTS),
        "chat": write_jsonl(folder / "chat.jsonl", CHAT_PROMPTS),
        "rewards": folder / "rewards.py",
    }


def grpo_args(base, data, out, reward, **overrides):
    opts = {**GRPO, **overrides}
    args = ["train", "--base", base, "--data", data, "--output-dir", out, "--reward", *reward]
    for k, v in opts.items():
        if v is None:
            continue
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [f"--no-{k.replace('_', '-')}"] if v is False else [flag, *v] if isinstance(v, list) else [flag, v]
    return args


@pytest.fixture(scope="module")
def peaky_model(tmp_path_factory):
    """The tiny Llama with weights 15x the usual scale: its frozen head then spans logits wide enough
    for a LoRA to move the sampling distribution far (at 0.02 the logits stay within about +-1.3)."""
    return build_tiny_llama(tmp_path_factory.mktemp("peaky"), initializer_range=0.3)


def test_a_toy_reward_is_learned(peaky_model, files, tmp_path):
    """The share of even token ids in the completions goes from about half to almost all."""
    result = lora_tune.train(
        base=str(peaky_model),
        data=str(files["prompts"]),
        output_dir=str(tmp_path / "run"),
        reward=f"{files['rewards']}:even",
        **{**GRPO, "max_steps": 24, "lr": 2e-2, "rank": 8, "lr_scheduler": "constant", "num_generations": 8, "micro_batch_size": 8},
    )
    steps = [r for r in result.metrics if "loss" in r]
    first, last = (sum(r["rewards/even/mean"] for r in part) / len(part) for part in (steps[:4], steps[-4:]))
    assert first < 0.7 and last > 0.9, (first, last)
    for key in ("reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/region_mean", "completions/mean_length"):
        assert key in steps[0] and math.isfinite(steps[0][key]), key
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "reward", "advantage"} <= samples[0].keys()


def test_chat_prompts_weights_and_callables(tiny_model, files, tmp_path):
    """Chat prompts reach the functions as messages and completions as assistant messages; two
    functions are summed with their weights; the API takes the functions themselves."""
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompt=prompts[0], completion=completions[0], columns=sorted(kwargs))
        return [1.0] * len(completions)

    result = lora_tune.train(
        base=str(tiny_model),
        data=str(files["chat"]),
        output_dir=str(tmp_path / "run"),
        reward=[spy, f"{files['rewards']}:short"],
        reward_weights=[0.5, 2.0],
        **{**GRPO, "max_steps": 1},
    )
    assert seen["prompt"][0]["role"] == "user" and seen["completion"][0]["role"] == "assistant"
    assert {"answer", "completion_ids"} <= set(seen["columns"])
    step = [r for r in result.metrics if "loss" in r][0]
    expected = 0.5 * step["rewards/spy/mean"] + 2.0 * step["rewards/short/mean"]
    assert step["reward"] == pytest.approx(expected, abs=1e-6)


def test_completions_do_not_depend_on_their_batch(tiny_model):
    """Each row draws from its own generator: the same row in another batch samples the same token."""
    scores = torch.randn(3, 50)
    alone = SeededSampling([torch.Generator().manual_seed(5)], 0.7, 10, 0.9)(None, scores[1:2])
    together = SeededSampling([torch.Generator().manual_seed(s) for s in (1, 5, 9)], 0.7, 10, 0.9)(None, scores)
    assert torch.equal(alone.argmax(-1), together[1:2].argmax(-1))
    # It samples softmax(scores / T): 4000 draws of 5 tokens land within 2.5% of each probability ...
    five = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    draws = torch.cat([SeededSampling([torch.Generator().manual_seed(s)], 0.8, 0, 1.0)(None, five).argmax(-1) for s in range(4000)])
    torch.testing.assert_close(torch.bincount(draws, minlength=5) / 4000.0, (five[0] / 0.8).softmax(-1), atol=0.025, rtol=0)
    # ... and top-k / top-p keep only the allowed tokens.
    picks = {int(SeededSampling([torch.Generator().manual_seed(s)], 5.0, 3, 1.0)(None, scores[:1]).argmax()) for s in range(40)}
    assert len(picks) == 3 and picks == set(torch.topk(scores[0], 3).indices.tolist())


@pytest.mark.parametrize("iterations,stop", [(1, 2), (2, 3)])
def test_resume_continues_exactly(iterations, stop, tiny_model, files, tmp_path, capsys):
    """A run stopped after `stop` steps and resumed equals one run straight through, bit for bit;
    with two iterations per generation batch, stopping inside one resumes on the saved batch."""
    reward = [f"{files['rewards']}:even"]
    common = {"num_iterations": iterations, "save_steps": 1, "lr_scheduler": "constant"}  # the same LR at every step of both runs
    code, _, err = run_cli(grpo_args(tiny_model, files["prompts"], tmp_path / "straight", reward, **common, max_steps=4), capsys)
    assert code == 0, err
    code, _, err = run_cli(grpo_args(tiny_model, files["prompts"], tmp_path / "resumed", reward, **common, max_steps=stop), capsys)
    assert code == 0, err
    assert (tmp_path / "resumed" / f"checkpoint-{stop}" / "rollout-rank0.safetensors").is_file() == (stop % iterations != 0)
    args = grpo_args(tiny_model, files["prompts"], tmp_path / "resumed", reward, **common, max_steps=4, resume=True)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert_bit_identical(adapter_tensors(tmp_path / "straight"), adapter_tensors(tmp_path / "resumed"))
    straight = [r["loss"] for r in read_metrics(tmp_path / "straight") if "loss" in r]
    resumed = [r["loss"] for r in read_metrics(tmp_path / "resumed") if "loss" in r]
    assert straight == resumed


def test_packed_rollouts_train_as_padded_ones(tiny_model, files, tmp_path, capsys):
    reward = [f"{files['rewards']}:even"]
    runs = {}
    for packing in (True, False):
        out = tmp_path / f"packing-{packing}"
        code, _, err = run_cli(grpo_args(tiny_model, files["prompts"], out, reward, packing=packing, max_steps=2, beta=0.05), capsys)
        assert code == 0, err
        runs[packing] = [r["loss"] for r in read_metrics(out) if "loss" in r], adapter_tensors(out)
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5, abs=1e-7)
    for name, tensor in runs[True][1].items():
        torch.testing.assert_close(tensor, runs[False][1][name], rtol=1e-4, atol=1e-6)


def test_a_failing_reward_function_stops_the_run_in_one_line(tiny_model, files, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(grpo_args(tiny_model, files["prompts"], out, [f"{files['rewards']}:broken"]), capsys)
    assert code == 1
    line = single_error_line(err.split("--- end ---")[-1])
    assert "broken" in line and "ValueError: no score today" in line and "at step 1" in line
    assert "no score today" in err.split("--- end ---")[0]  # the user's own traceback, labelled
    code, _, err = run_cli(grpo_args(tiny_model, files["prompts"], tmp_path / "nan", [f"{files['rewards']}:nan"]), capsys)
    assert code == 1 and "nan" in single_error_line(err)
    # None for every completion: nothing to learn from (a NaN reward and zero gradients), stopped the same way
    code, _, err = run_cli(grpo_args(tiny_model, files["prompts"], tmp_path / "none", [f"{files['rewards']}:unscored"]), capsys)
    line = single_error_line(err)
    assert code == 1 and "reward function unscored returned None for all 8 completions of generation batch 0" in line
    assert "at step 1" in line and not (tmp_path / "none" / "adapter_model.safetensors").exists()


BAD = {
    "no reward": ({"reward": []}, "needs at least one --reward"),
    "one generation": ({"num_generations": 1}, "--num-generations"),
    "groups split": ({"num_generations": 3}, "not a multiple of --num-generations 3"),
    "weights count": ({"reward_weights": ["1", "2"]}, "2 weights for 1 --reward"),
    "groups split between processes": ({"micro_batch_size": 2, "grad_accum": 1, "nproc": 2, "zero": 1}, "2 completions per process"),
    "vllm rollouts without a server": (
        {"rollout": "vllm", "vllm_url": "http://127.0.0.1:9"},
        "--rollout vllm: no vLLM server answers at http://127.0.0.1:9 ([Errno 111] Connection refused); start it with: "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server --model",
    ),
    "vllm rollouts of a DoRA adapter": (
        {"rollout": "vllm", "dora": True},
        "--rollout vllm: vLLM can't use this run's adapter: vLLM refuses DoRA",
    ),
    "vllm colocated where vllm is not installed": (
        {"rollout": "vllm", "vllm_mode": "colocate"},
        "--vllm-mode colocate: vLLM is not installed",
    ),
    "vllm options without vllm rollouts": ({"vllm_url": "http://127.0.0.1:9"}, "--vllm-url applies to --rollout vllm"),
    "a column the data lacks": ({"data": "no-answer"}, "takes the data column 'answer', which --data lacks"),
    "eval split": ({"eval_split": 0.25}, "--eval-split"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_loading(case, tiny_model, files, tmp_path, capsys):
    if case == "vllm colocated where vllm is not installed" and importlib.util.find_spec("vllm"):
        pytest.skip("vLLM is installed in this environment")
    overrides, expected = BAD[case]
    overrides = dict(overrides)
    reward = overrides.pop("reward", [f"{files['rewards']}:even"])
    data = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "Hi"}] * 4) if overrides.pop("data", None) else files["prompts"]
    args = grpo_args(tiny_model, data, tmp_path / "run", reward, **overrides)
    if not reward:
        args.remove("--reward")
    code, _, err = run_cli(args, capsys)
    assert code == 2 and expected in single_error_line(err), err
    assert not (tmp_path / "run").exists()


def test_grpo_options_belong_to_grpo_and_prompts_to_grpo(tiny_model, files, data_files, tmp_path, capsys):
    args = ["train", "--base", tiny_model, "--data", data_files["alpaca"], "--output-dir", tmp_path / "a", "--num-generations", "4"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "--num-generations applies to --objective grpo" in single_error_line(err)
    code, _, err = run_cli(["train", "--base", tiny_model, "--data", files["prompts"], "--output-dir", tmp_path / "b"], capsys)
    assert code == 2 and "use --objective grpo" in single_error_line(err)
    reward = [f"{files['rewards']}:even"]
    code, _, err = run_cli(grpo_args(tiny_model, data_files["alpaca"], tmp_path / "c", reward), capsys)
    assert code == 2 and "--objective grpo trains on prompts" in single_error_line(err)


def test_resume_refuses_changed_reward_functions(tiny_model, files, tmp_path, capsys):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(textwrap.dedent(REWARDS))
    args = grpo_args(tiny_model, files["prompts"], tmp_path / "run", [f"{rewards}:even"], max_steps=1)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    rewards.write_text(textwrap.dedent(REWARDS).replace("t % 2 == 0", "t % 2 == 1"))
    code, _, err = run_cli([*args, "--resume", "--max-steps", "2"], capsys)
    line = single_error_line(err)
    assert code == 2 and "the reward functions changed since the checkpoint was written (even)" in line
    assert "pass --allow-config-change to score with these" in line
    # A bug fixed in a reward is the common case: the documented override takes it, says so, records it.
    code, _, err = run_cli([*args, "--resume", "--max-steps", "2", "--allow-config-change"], capsys)
    assert code == 0, err
    assert "resuming with changed reward functions (--allow-config-change), scoring from step 2: even" in err
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["config_changes"] == [{"step": 1, "changed": {"reward functions": "even"}}]
