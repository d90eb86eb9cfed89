"""Agentic GRPO end to end on a tiny model that calls tools (tests/conftest.py's `tiny_agent`): the
calculator through the CLI (tool results in the rollout, never in the loss), exact resume inside a
multi-turn generation batch, environments (a fresh instance per completion, its reward, TRL's
arguments), tools that hang, raise or flood, 2 ranks under ZeRO-3 against one process, and bad
input refused in one line before loading."""

from __future__ import annotations

import json
import textwrap

import pytest
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoTokenizer

import lora_tune
from lora_tune.models.head import IGNORE

from helpers import ROOT, adapter_tensors, assert_bit_identical, read_metrics, run_cli, run_jobs, single_error_line, write_jsonl

EXAMPLES = ROOT / "examples"
DATA = EXAMPLES / "data" / "arithmetic.jsonl"
AGENT = {
    "objective": "grpo",
    "precision": "fp32",
    "rank": 8,
    "lr": 2e-2,
    "optim": "adamw",
    "seed": 7,
    "num_generations": 4,
    "micro_batch_size": 4,
    "grad_accum": 2,
    "max_new_tokens": 80,
    "max_seq_len": 512,
    "temperature": 0.7,
    "max_tool_calls": 2,
    "lr_scheduler": "constant",
}
CALCULATOR = f"{EXAMPLES / 'tools.py'}:calculator"

FILES = '''
import time

def grounded(prompts, completions, **kwargs):
    """1 when the last turn repeats a number a tool returned: learnable by copying."""
    scores = []
    for turns in completions:
        results = [t["content"] for t in turns if t["role"] == "tool"]
        scores.append(1.0 if results and results[-1] in turns[-1]["content"] else 0.0)
    return scores

CALLS = []

def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % and parentheses.

    Args:
        expression: the expression, e.g. "37 * 12 + 4"
    """
    CALLS.append(expression)  # in turn: it hangs, raises, floods
    if len(CALLS) % 3 == 1:
        time.sleep(3)
    if len(CALLS) % 3 == 2:
        raise ValueError("no maths today")
    return "9" * 4000

def untyped(expression):
    """No hints.

    Args:
        expression: the expression
    """

def undocumented(expression: str) -> str:
    return expression

class NoReset:
    def calculator(self, expression: str) -> str:
        """Calculates.

        Args:
            expression: the expression
        """
        return "1"

class Counter:
    """Counts its own calls: an instance shared between completions would count theirs too."""

    made = []

    def __init__(self):
        Counter.made.append(self)
        self.calls, self.row = 0, None

    def reset(self, answer, **row):
        self.row = answer
        return " (count with me)"

    def calculator(self, expression: str) -> str:
        """Calculates.

        Args:
            expression: the expression
        """
        self.calls += 1
        return str(self.calls)

    def get_reward(self) -> float:
        return float(self.calls)

class Other(Counter):
    pass
'''


def agent_args(base, out, data=DATA, **overrides) -> list:
    opts = {**AGENT, **overrides}
    args = ["train", "--base", base, "--data", data, "--output-dir", out]
    for key, value in opts.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag, *value] if isinstance(value, list) else [flag] if value is True else [flag, value]
    return args


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent-files")
    (folder / "agent.py").write_text(textwrap.dedent(FILES))
    return folder / "agent.py"


def test_the_calculator_trains_through_the_cli_and_resumes_exactly(tiny_agent, user_files, tmp_path, capsys):
    """Completions call the calculator and continue after its result; the tool results are in the
    rollout's inputs but never among its labels (the saved micro-batches carry the mask), the
    length metrics count the model's tokens only, and a run stopped inside a generation batch of
    two iterations resumes bit for bit."""
    reward = ["--reward", f"{EXAMPLES / 'rewards.py'}:correct", f"{user_files}:grounded", "--tools", CALCULATOR]
    common = {"num_iterations": 2, "save_steps": 1}
    code, _, err = run_cli([*agent_args(tiny_agent, tmp_path / "straight", max_steps=3, **common), *reward], capsys)
    assert code == 0, err
    code, _, err = run_cli([*agent_args(tiny_agent, tmp_path / "resumed", max_steps=1, **common), *reward], capsys)
    assert code == 0, err
    saved_file = str(tmp_path / "resumed" / "checkpoint-1" / "rollout-rank0.safetensors")
    saved = load_file(saved_file)
    with safe_open(saved_file, "pt") as f:
        counted = sum(b["counts"]["tokens"] for b in json.loads(f.metadata()["batches"]))
    code, _, err = run_cli([*agent_args(tiny_agent, tmp_path / "resumed", max_steps=3, resume=True, **common), *reward], capsys)
    assert code == 0, err
    assert_bit_identical(adapter_tensors(tmp_path / "straight"), adapter_tensors(tmp_path / "resumed"))
    steps = [r for r in read_metrics(tmp_path / "straight") if "loss" in r]
    assert [r["loss"] for r in steps] == [r["loss"] for r in read_metrics(tmp_path / "resumed") if "loss" in r]
    first = steps[0]
    assert first["tools/call_frequency"] >= 0.5 and first["tools/failure_frequency"] < 0.5, first
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent)
    inputs = [saved[k] for k in sorted(saved) if k.endswith(".input_ids")]
    labels = [saved[k] for k in sorted(saved) if k.endswith(".labels")]
    seen = "".join(tokenizer.decode(i[0].tolist()) for i in inputs)
    trained = "".join(tokenizer.decode(lab[0][lab[0] != IGNORE].tolist()) for lab in labels)
    assert "<tool_response>" in seen and "<tool_response>" not in trained and "<tool_call>" in trained
    # The step's token count (dapo's normaliser, TRL's loss_mask.sum()) is the model's own tokens of
    # the 8 completions, which the length metrics count too.
    assert counted == pytest.approx(first["completions/mean_length"] * 8)


class Guess:
    """Each instance counts its own calls (the model was primed on the calculator's schema: the same one here)."""

    made: list = []

    def __init__(self):
        Guess.made.append(self)
        self.calls = 0

    def reset(self, answer, **row) -> str:
        self.answer = answer
        return " "

    def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression of numbers, + - * / // % and parentheses.

        Args:
            expression: the expression, e.g. "37 * 12 + 4"
        """
        self.calls += 1
        return str(self.calls)

    def get_reward(self) -> float:
        return float(self.calls)


def test_environments_are_fresh_per_completion_and_own_a_reward(tiny_agent, tmp_path):
    """One instance per completion (each counts only its own calls: no state leaks), reset with the
    row's columns, its reward named after the class, and reward functions get TRL's arguments: the
    completion as turns, the prompt with what reset() appended, and the environments."""
    seen = {}

    def spy(prompts, completions, environments, **kwargs):
        seen.update(prompts=prompts, completions=completions, environments=environments)
        return [0.0] * len(completions)

    Guess.made.clear()
    result = lora_tune.train(
        base=str(tiny_agent), data=str(DATA), output_dir=str(tmp_path / "run"), reward=spy, environment=Guess, **{**AGENT, "max_steps": 1}
    )
    environments = seen["environments"]
    assert len(environments) == 8 and len({id(e) for e in environments}) == 8 and all(type(e) is Guess for e in environments)
    assert len(Guess.made) == 8 + 1  # one per completion, and the probe preflight builds to read its tools
    for environment, turns in zip(environments, seen["completions"]):
        assert environment.calls == sum(t["role"] == "tool" and t["content"].isdigit() for t in turns)  # its own calls, no one else's
    assert sum(e.calls for e in environments) > 0
    assert all(p[-1]["content"].endswith("? ") for p in seen["prompts"])  # what reset() said, appended
    assert {e.answer for e in environments} <= {json.loads(line)["answer"] for line in DATA.read_text().splitlines()}
    step = [r for r in result.metrics if "loss" in r][0]
    assert step["rewards/Guess/mean"] == pytest.approx(sum(e.calls for e in environments) / 8)
    assert step["reward"] == pytest.approx(step["rewards/Guess/mean"])  # spy scores 0: the environment's reward, weight 1


def test_tools_that_hang_raise_or_flood_leave_the_run_going(tiny_agent, user_files, tmp_path, capsys):
    out = tmp_path / "run"
    args = agent_args(tiny_agent, out, max_steps=1, tool_timeout=0.5, max_tool_result_tokens=16, grad_accum=1, max_tool_calls=1)
    code, _, err = run_cli([*args, "--reward", f"{user_files}:grounded", "--tools", f"{user_files}:calculator"], capsys)
    assert code == 0, err
    step = [r for r in read_metrics(out) if "loss" in r][0]
    assert step["tools/call_frequency"] > 0 and 0 < step["tools/failure_frequency"] < 1 and step["tools/truncated_frequency"] > 0, step


def test_two_ranks_under_zero3_train_what_one_process_does(tiny_agent, user_files, tmp_path, capsys):
    """Each rank plays its share of the episodes; ZeRO-3 decodes in lockstep, turn by turn (a rank
    with no episode going decodes a placeholder): the same rewards, tool metrics and losses."""
    pytest.importorskip("deepspeed")
    reward = ["--reward", f"{user_files}:grounded", "--tools", CALCULATOR]
    two = agent_args(tiny_agent, tmp_path / "two", max_steps=2, grad_accum=1, nproc=None, zero=3)
    run_jobs([{"argv": [str(a) for a in [*two, *reward]], "stderr": str(tmp_path / "two.err")}], tmp_path)
    code, _, err = run_cli([*agent_args(tiny_agent, tmp_path / "one", max_steps=2), *reward], capsys)
    assert code == 0, err
    two_ranks, one = ([r for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("two", "one"))
    for key in ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length"):
        assert [r[key] for r in two_ranks] == [r[key] for r in one], key
    assert [r["loss"] for r in two_ranks] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=1e-6)


BAD = {
    "no tool file": (["--tools", "missing.py:calculator"], "--tools missing.py:calculator: no file"),
    "no such function": (["--tools", "{examples}/tools.py:calc"], "has no function calc; the functions it defines: calculator"),
    "no type hints": (["--tools", "{user}:untyped"], "Argument expression is missing a type hint in function untyped; a tool needs type"),
    "no docstring": (["--tools", "{user}:undocumented"], "undocumented because it has no docstring"),
    "environment without reset": (["--environment", "{user}:NoReset"], "NoReset has no reset method"),
    "unknown environment": (
        ["--environment", "{user}:Counter", "{user}:Other", "--data", "{rows}"],
        "--data row 1 selects the environment 'Countr', which is not among --environment's (Counter, Other) (did you mean Counter?)",
    ),
    "a column reset needs": (["--environment", "{user}:Counter", "--data", "{bare}"], "reset(**row) can't take --data row 1's columns"),
    "unknown tool in a row": (["--tools", "{examples}/tools.py:calculator", "--data", "{named}"], "names the tool 'abacus'"),
    "text prompts": (["--tools", "{examples}/tools.py:calculator", "--data", "{text}"], "tools need chat prompts"),
    "template without tools": (["--tools", "{examples}/tools.py:calculator", "--base", "{plain}"], "chat template has no tool support"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_loading(case, tiny_agent, tiny_model, user_files, tmp_path, capsys):
    extra, expected = BAD[case]
    chat = [{"role": "user", "content": "Hi"}]
    files = {
        "examples": EXAMPLES,
        "user": user_files,
        "plain": tiny_model,
        "rows": write_jsonl(tmp_path / "rows.jsonl", [{"prompt": chat, "answer": "1", "environment": "Countr"}]),
        "bare": write_jsonl(tmp_path / "bare.jsonl", [{"prompt": chat}]),
        "named": write_jsonl(tmp_path / "named.jsonl", [{"prompt": chat, "answer": "1", "tools": ["abacus"]}]),
        "text": write_jsonl(tmp_path / "text.jsonl", [{"prompt": "Hi", "answer": "1"}]),
    }
    extra = [e.format(**files) for e in extra]
    args = agent_args(tiny_agent, tmp_path / "run", max_steps=1)
    for flag in ("--data", "--base"):  # the case's own
        if flag in extra:
            k = args.index(flag)
            del args[k : k + 2]
    code, _, err = run_cli([*args, "--reward", f"{EXAMPLES / 'rewards.py'}:correct", *extra], capsys)
    assert code == 2 and expected in single_error_line(err), err
    assert "Loading weights" not in err and not (tmp_path / "run").exists()
