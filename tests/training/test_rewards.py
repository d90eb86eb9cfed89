"""GRPO's reward functions (lora_tune.training.rewards): users' TRL-style functions loaded from a file,
a module or as callables, every bad --reward refused in one line before anything loads, failures
while scoring named by function and completion with the user's own traceback, and advantages equal
to TRL's own arithmetic."""

from __future__ import annotations

import math
import sys
import textwrap
from functools import partial

import numpy as np
import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd

from lora_tune.errors import UserError
from lora_tune.training import rewards as rewards_module
from lora_tune.training.rewards import RewardError, advantages, load_rewards, nanstd, unscorable

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
COMPLETIONS = ["2", "5", "6", "8"]


def write(folder, name: str, text: str):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def score(rewards, completions=COMPLETIONS, step=0, **columns):
    return rewards.score(PROMPTS[: len(completions)], completions, [[1]] * len(completions), columns, step)


# --- loading ----------------------------------------------------------------------------------------------
def test_a_file_relative_absolute_or_under_home_loads_and_scores(tmp_path, monkeypatch):
    write(tmp_path, "helper.py", "def same(a, b):\n    return float(a == b)\n")
    path = write(
        tmp_path,
        "my_rewards.py",
        """
        from helper import same  # a neighbour of the file, importable while it loads

        def accuracy(completions, answer, **kwargs):
            return [same(c, a) for c, a in zip(completions, answer)]
        """,
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    path_before = list(sys.path)
    for spec in ("my_rewards.py:accuracy", str(path) + ":accuracy", "~/my_rewards.py:accuracy", "./my_rewards.py:accuracy"):
        rewards = load_rewards([spec], None)
        assert rewards.names == ("accuracy",) and rewards.weights.tolist() == [1.0]
        assert rewards.columns() == {"accuracy": ("answer",)}
        assert score(rewards, answer=["2", "4", "6", "8"]).tolist() == [[1.0], [0.0], [1.0], [1.0]]
    assert sys.path == path_before  # the file's folder was on it only while the file ran
    assert not (tmp_path / "__pycache__" / "my_rewards.cpython-311.pyc").exists()  # nothing written beside the user's file


def test_a_module_loads_by_its_dotted_name(tmp_path, monkeypatch):
    package = tmp_path / "reward_pkg_t1"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package, "scoring.py", "def length(prompts, completions, **kwargs):\n    return [len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = load_rewards(["reward_pkg_t1.scoring:length"], [2.0])
    assert rewards.names == ("length",) and rewards.weights.tolist() == [2.0]
    assert score(rewards, ["a", "bb", "", "dddd"])[:, 0].tolist() == [1.0, 2.0, 0.0, 4.0]


def test_callables_are_taken_as_they_are_chat_completions_and_the_trainer_state_passed():
    seen = {}

    def contains_answer(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
        seen.update(step=trainer_state.global_step, prompts=prompts, ids=completion_ids, extra=sorted(kwargs))
        return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]

    def by_position(p, c, **kwargs):  # names neither prompts nor completions: the first two positional arguments
        return [None if "skip" in x[0]["content"] else len(p[i]) for i, x in enumerate(c)]

    rewards = load_rewards([contains_answer, by_position, lambda completions, **kw: [True] * len(completions)], [1.0, 0.5, 1.0])
    assert rewards.names == ("contains_answer", "by_position", "<lambda>")
    chat_prompts = [[{"role": "user", "content": q}] for q in ("a", "b")]
    chat = [[{"role": "assistant", "content": t}] for t in ("it is 4", "skip")]
    columns = {"answer": ["4", "9"], "level": [1, 2], "prompt": ["dropped"] * 2, "trainer_state": ["dropped"] * 2}
    got = rewards.score(chat_prompts, chat, [[5, 6], [7]], columns, 7)
    assert got[0].tolist() == [1.0, 1.0, 1.0] and got[1, 0] == 0.0 and math.isnan(got[1, 1]) and got[1, 2] == 1.0
    assert seen == {"step": 7, "prompts": chat_prompts, "ids": [[5, 6], [7]], "extra": ["level"]}


def bad(tmp_path, monkeypatch, text: str | None = None, name: str = "rewards.py"):
    monkeypatch.chdir(tmp_path)
    if text is not None:
        write(tmp_path, name, text)


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        ("def f(completions, **kw): return []", "rewards.py", "--reward rewards.py: name the function after a colon"),
        ("def f(completions, **kw): return []", "rewards.py:", "--reward rewards.py:: '' after the colon is not a Python function name"),
        ("def f(completions, **kw): return []", "rewards.py:my-f", "'my-f' after the colon is not a Python function name"),
        (None, "missing.py:f", "--reward missing.py:f: no file "),
        ("def f(completions, **kw): return []", "rewards.txt:f", "--reward rewards.txt:f: rewards.txt is not a .py file"),
        (
            "import os\n\nx = y + 1\n",
            "rewards.py:f",
            "--reward rewards.py:f: importing rewards.py raised NameError: name 'y' is not defined (line 3)",
        ),
        ("import os\ndef f(:\n", "rewards.py:f", "--reward rewards.py:f: importing rewards.py raised SyntaxError: invalid syntax (line 2)"),
        ("import sys\nsys.exit('no arguments given')\n", "rewards.py:f", "raised SystemExit: no arguments given (line 2)"),
        (
            "def accuracy(completions, **kw): return []\ndef fmt(completions, **kw): return []\n",
            "rewards.py:accuracyy",
            "--reward rewards.py:accuracyy: rewards.py has no function accuracyy (did you mean accuracy?); the functions it defines: "
            "accuracy, fmt",
        ),
        ("f = 3\n", "rewards.py:f", "--reward rewards.py:f: f in rewards.py is an int, not a function"),
        ("def f(prompts, completions): return []\n", "rewards.py:f", "--reward rewards.py:f: f(prompts, completions) takes no **kwargs"),
        (
            "def f(x, /, **kwargs): return []\n",
            "rewards.py:f",
            "--reward rewards.py:f: f(x, /, **kwargs) can't be called as f(prompts, completions, completion_ids=..., **kwargs) (",
        ),
        (
            "def f(completion, **kwargs): return []\n",
            "rewards.py:f",
            "takes 'completion', which is never passed (TRL's name is completions)",
        ),
        ("class F:\n    def __init__(self, completions, **kw): pass\n", "rewards.py:F", "--reward rewards.py:F: F is a class"),
        ("async def f(completions, **kw): return []\n", "rewards.py:f", "--reward rewards.py:f: f is an async function"),
        (None, "no_such_module_zq:f", "--reward no_such_module_zq:f: no module named no_such_module_zq on the Python path"),
        (None, "not a module:f", "--reward not a module:f: 'not a module' is neither a .py file nor a module name"),
    ],
)
def test_a_bad_reward_is_one_line_naming_the_spec(tmp_path, monkeypatch, source, spec, message):
    bad(tmp_path, monkeypatch, source, "rewards.txt" if spec.startswith("rewards.txt") else "rewards.py")
    modules_before, path_before = set(sys.modules), list(sys.path)
    with pytest.raises(UserError) as e:
        load_rewards([spec], None)
    assert message in str(e.value) and str(e.value).startswith(f"--reward {spec}") and "\n" not in str(e.value)
    assert not any(m.startswith("lora_tune_reward_") for m in set(sys.modules) - modules_before)  # a failed file leaves no module
    assert sys.path == path_before


def test_a_folder_a_module_that_fails_and_a_module_given_as_a_file_are_named(tmp_path, monkeypatch):
    bad(tmp_path, monkeypatch)
    (tmp_path / "folder.py").mkdir()
    with pytest.raises(UserError, match=r"^--reward folder.py:f: folder.py is a folder; give the path of a .py file$"):
        load_rewards(["folder.py:f"])
    write(tmp_path, "broken_mod_t2.py", "\n\nraise RuntimeError('needs a GPU')\n")
    write(tmp_path, "plain_rewards_t2.py", "def f(completions, **kw): return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"importing broken_mod_t2 raised RuntimeError: needs a GPU \(broken_mod_t2.py, line 3\)$"):
        load_rewards(["broken_mod_t2:f"])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(UserError, match=r"no module named plain_rewards_t2 on the Python path \(did you mean plain_rewards_t2.py:f\?\)"):
        load_rewards(["plain_rewards_t2:f"])


def test_bad_weights_and_bad_callables_are_refused():
    def f(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(UserError, match=r"^--reward-weights: 1 weights for 2 reward functions; give one weight per function"):
        load_rewards([f, f], [1.0])
    for weight in (math.nan, math.inf, "x"):
        with pytest.raises(UserError, match=r"^--reward-weights: weight 2 is .*, not a finite number"):
            load_rewards([f, f], [1.0, weight])
    with pytest.raises(UserError, match=r"^reward function 2 is an int, neither a function nor a 'file.py:func' spec"):
        load_rewards([f, 3])
    with pytest.raises(UserError, match=r"^reward function g: g\(prompts, completions\) takes no \*\*kwargs"):
        load_rewards([lambda completions, **kw: [], _no_kwargs])
    with pytest.raises(UserError, match=r"^--objective grpo needs at least one --reward"):
        load_rewards([], None)


def _no_kwargs(prompts, completions):
    return []


_no_kwargs.__name__ = "g"


class LengthScore:
    def __call__(self, completions, **kwargs):
        return [float(len(c)) for c in completions]


def test_names_are_the_functions_own_made_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        write(tmp_path / folder, "r.py", "def f(completions, **kw): return [0.0] * len(completions)\n")

    def f(completions, scale=1.0, **kw):
        return [scale] * len(completions)

    rewards = load_rewards(["a/r.py:f", "b/r.py:f", f, partial(f, scale=2.0), LengthScore()], None)
    assert rewards.names == ("f", "f_2", "f_3", "f_4", "LengthScore")
    assert score(rewards, ["x", "yy", "z", "w"])[:, 3:].tolist() == [[2.0, 1.0], [2.0, 2.0], [2.0, 1.0], [2.0, 1.0]]


def test_the_fingerprint_follows_the_files_bytes_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "my_rewards.py", "def f(completions, **kw):\n    return [1.0] * len(completions)\n")
    write(tmp_path, "more.py", "def g(completions, **kw):\n    return [1.0] * len(completions)\n")
    first = load_rewards(["my_rewards.py:f", "more.py:g"]).fingerprint()
    assert load_rewards(["my_rewards.py:f", "more.py:g"]).fingerprint() == first
    assert load_rewards([str(path) + ":f", "./more.py:g"], [1.0, 1.0]).fingerprint() == first  # another path to the same files
    assert load_rewards(["more.py:g", "my_rewards.py:f"]).fingerprint() != first  # the order decides which weight is whose
    path.write_text(path.read_text().replace("1.0", "2.0"))
    assert load_rewards(["my_rewards.py:f", "more.py:g"]).fingerprint() != first

    package = tmp_path / "fp_mod_t3.py"
    package.write_text("def h(completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = load_rewards(["fp_mod_t3:h"]).fingerprint()
    assert load_rewards(["fp_mod_t3:h"]).fingerprint() == before
    package.write_text(package.read_text() + "# changed\n")
    assert load_rewards(["fp_mod_t3:h"]).fingerprint() != before

    def local(completions, **kw):
        return [0.0] * len(completions)

    assert load_rewards([local]).fingerprint() == load_rewards([local]).fingerprint()
    assert "test_the_fingerprint_follows_the_files_bytes_and_nothing_else.<locals>.local@sha256:" in load_rewards([local]).fingerprint()
    assert load_rewards([LengthScore()]).fingerprint() != load_rewards([local]).fingerprint()


# --- scoring ----------------------------------------------------------------------------------------------
def returning(value):
    def f(completions, **kwargs):
        return value

    return f


def test_none_is_nan_and_a_row_every_function_leaves_is_unscorable():
    rewards = load_rewards(
        [returning([None, 1, True, np.float32(0.5)]), returning(torch.tensor([0.0, 2.0, 3.0, 4.0])), returning((None,) * 4)]
    )
    assert rewards.names == ("f", "f_2", "f_3")
    got = score(rewards)
    assert got.dtype == torch.float32 and got.shape == (4, 3)
    assert math.isnan(got[0, 0]) and got[1:, 0].tolist() == [1.0, 1.0, 0.5] and got[:, 1].tolist() == [0.0, 2.0, 3.0, 4.0]
    assert unscorable(got).tolist() == [False] * 4
    assert unscorable(score(load_rewards([returning([None, 1.0, None, 2.0]), returning([None, None, 1.0, None])]))).tolist() == [
        True,
        False,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1.0, 2.0, 3.0], r"^reward function f returned 3 values for 4 completions: return one reward \(or None\) per completion"),
        (1.0, r"^reward function f returned a float, not a list of one reward per completion: return a list of 4 numbers"),
        ("1234", r"^reward function f returned a str, not a list"),
        (torch.ones(4, 1), r"^reward function f returned a Tensor of shape \(4, 1\), not a list"),
        ([1.0, "yes", 0.0, 0.0], r"^reward function f returned a str \('yes'\) for completion 1 \(counting from 0\): return a number"),
        ([1.0, 0.0, {"score": 1}, 0.0], r"^reward function f returned a dict \(\{'score': 1\}\) for completion 2"),
        ([1.0, 0.0, 0.0, math.nan], r"^reward function f returned nan for completion 3 \(counting from 0\): return a finite number"),
        ([-math.inf, 0.0, 0.0, 0.0], r"^reward function f returned -inf for completion 0 "),
        ([1e300, 0.0, 0.0, 0.0], r"^reward function f returned 1e\+300 for completion 0 .*float32's range"),
    ],
)
def test_a_bad_return_value_stops_naming_the_function_and_the_completion(value, message):
    rewards = load_rewards([returning([0.0] * 4), returning(value)])
    assert rewards.names == ("f", "f_2")
    with pytest.raises(RewardError, match=message.replace("function f ", "function f_2 ")):
        score(rewards)


def test_a_raising_function_prints_only_its_own_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(
        tmp_path,
        "user_rewards.py",
        """
        def parse(text):
            return int(text)

        def numeric(completions, **kwargs):
            return [parse(c) for c in completions]
        """,
    )
    rewards = load_rewards(["user_rewards.py:numeric"])
    with pytest.raises(RewardError) as e:
        score(rewards, ["1", "2", "three", "4"])
    assert str(e.value) == (
        "reward function numeric raised ValueError: invalid literal for int() with base 10: 'three' (its traceback is above)"
    )
    err = capsys.readouterr().err
    shown = err[err.index("--- traceback from your reward function numeric ---") : err.index("--- end ---")]
    assert 'user_rewards.py", line 6, in numeric' in shown and 'user_rewards.py", line 3, in parse' in shown
    assert "ValueError: invalid literal for int() with base 10: 'three'" in shown
    assert rewards_module.__file__ not in err and "lora_tune" not in err


def test_a_missing_column_is_named():
    rewards = load_rewards([lambda completions, answer, **kw: [0.0] * len(completions)])
    with pytest.raises(
        RewardError, match=r"^reward function <lambda> takes a column 'answer' the data doesn't have \(its columns: level\); if it is meant"
    ):
        score(rewards, level=[1, 2, 3, 4])


# --- advantages: TRL's arithmetic ----------------------------------------------------------------------------
def trl_advantages(rewards_per_func, reward_weights, num_generations, scale_rewards, names):
    """GRPOTrainer._generate_and_score_completions in trl/trainer/grpo_trainer.py (TRL 1.16.0), lines
    2759-2788 (the unscorable mask and the "sum_then_normalize" branch), 2810 (nan_to_num) and
    2820-2830 (the logged metrics), transcribed line for line (one process: no slicing), with TRL's
    own nanstd."""
    nanstd = trl_nanstd
    metrics = {}
    device = rewards_per_func.device
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        if rewards.numel() > 1:
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    for i, reward_func_name in enumerate(names):
        metrics[f"rewards/{reward_func_name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{reward_func_name}/std"] = nanstd(rewards_per_func[:, i]).item()
    logged = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    logged[unscorable_mask] = torch.nan
    metrics["reward"] = torch.nanmean(logged).item()
    metrics["reward_std"] = nanstd(logged).item()
    metrics["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    return advantages, rewards, metrics


def per_func_scores() -> torch.Tensor:
    """Groups of 4 completions, 2 functions: varied; None in one function; every reward tied (0.1,
    not a power of two: TRL's mean rounds); an unscorable row; a single scored completion; none scored."""
    nan = math.nan
    g = torch.Generator().manual_seed(0)
    varied = torch.rand(4, 2, generator=g) * 3 - 1
    rows = [
        *varied.tolist(),
        [1.0, nan], [nan, 0.25], [0.5, 0.5], [nan, 2.0],
        [0.1, 0.1], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1],
        [nan, nan], [2.0, 1.0], [0.0, 0.0], [1.0, -1.0],
        [nan, nan], [nan, nan], [0.7, nan], [nan, nan],
        [nan, nan], [nan, nan], [nan, nan], [nan, nan],
    ]  # fmt: skip
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale):
    per_func = per_func_scores()
    weights = torch.tensor([1.0, 0.5])
    names = ["accuracy", "format"]
    expected_adv, expected_rewards, expected_stats = trl_advantages(per_func.clone(), weights, 4, scale, names)
    adv, total, stats = advantages(per_func.clone(), weights.tolist(), 4, scale, names)
    assert adv.dtype == torch.float32 and adv.shape == (24,)
    torch.testing.assert_close(adv, expected_adv, atol=1e-6, rtol=0)
    torch.testing.assert_close(total, expected_rewards, atol=1e-6, rtol=0, equal_nan=True)
    groups = stats.pop("zero_std_groups")
    assert stats.keys() == expected_stats.keys()
    for key, value in expected_stats.items():
        assert value == pytest.approx(stats[key], abs=1e-6, nan_ok=True), key
    assert groups.tolist() == [False, False, True, False, True, True]  # tied; one scored; none scored
    assert adv[20:].tolist() == [0.0] * 4 and adv[16:20].tolist() == [0.0] * 4 and adv[12] == 0.0  # unscorable rows, a lone score
    assert expected_stats["frac_reward_zero_std"] == pytest.approx(
        4 / 24 if scale != "batch" else 0.0
    )  # the tied group is seen as TRL sees it


def test_nanstd_is_trls():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    x[0, :4] = math.nan
    x[1, 2] = math.nan
    x[2] = math.nan
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1), equal_nan=True)
    torch.testing.assert_close(nanstd(x), trl_nanstd(x), equal_nan=True)


def test_bad_scale_or_split_groups_are_refused():
    with pytest.raises(ValueError, match="scale"):
        advantages(torch.zeros(4, 1), [1.0], 2, "batch-group")
    with pytest.raises(ValueError, match="groups of 3"):
        advantages(torch.zeros(4, 1), [1.0], 3, "group")
