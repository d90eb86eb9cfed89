"""The reward functions of online RL (GRPO): users' own, with TRL's signature, so the functions they
wrote for TRL's GRPOTrainer work unchanged, and the advantages TRL computes from their scores.

A function is called as TRL calls it: `f(prompts=..., completions=..., completion_ids=...,
trainer_state=..., **columns) -> list[float | None]`, once per generation batch with every
completion; `columns` are the data's other columns (one entry per completion), `trainer_state` a
small object with `global_step`. A function that names neither `prompts` nor `completions` gets them
as its first two positional arguments. None means "not scored by this function"; a completion no
function scores is unscorable: its reward is NaN and its advantage 0 (TRL's rule).

Everything that can be wrong with a `--reward` is found when it loads, before any model does (a
`UserError` naming the spec); what goes wrong while training (the function raises, returns the
wrong count or a value that isn't a finite number) is a `RewardError`, which the loop turns into a
clean stop that keeps the last checkpoint, with the user's own traceback printed above it.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from lora_tune.errors import ESCAPED_BREAKS, UserError, first_line
from lora_tune.training import user_code
from lora_tune.training.user_code import callable_name, kind, source_identity, user_traceback

SCALES = ("group", "batch", "none")  # TRL's scale_rewards
EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4)
# The keywords a function is called with; data columns of these names can't replace them (TRL drops
# its prompt / completion / completion_ids columns the same way, and sets trainer_state over any column).
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "prompt", "completion")
F32_MAX = torch.finfo(torch.float32).max


class RewardError(Exception):
    """A reward function failed while training: one line naming the function (and the completion)."""

    def __init__(self, message: str):
        super().__init__(message.translate(ESCAPED_BREAKS))


@dataclass(frozen=True)
class TrainerState:
    """What TRL's `trainer_state` argument gives a reward function here: the optimizer steps done."""

    global_step: int


@dataclass(frozen=True, eq=False)
class RewardFunction:
    func: Callable
    name: str  # TRL's reward_func_names: the function's __name__, made unique
    identity: str  # what fingerprint() says of it
    by_keyword: bool  # called as TRL calls it (every argument by name), or with prompts, completions first
    columns: tuple[str, ...]  # data columns it requires (parameters without a default that aren't TRL's arguments)

    def __call__(self, prompts, completions, completion_ids, columns: dict[str, list], state: TrainerState) -> torch.Tensor:
        missing = [c for c in self.columns if c not in columns]
        if missing:
            have = ", ".join(sorted(columns)) or "none but the prompt"
            raise RewardError(
                f"reward function {self.name} takes a column {missing[0]!r} the data doesn't have (its columns: {have}); if it is meant "
                "to get the completions (or prompts), name it completions (or prompts)"
            )
        try:
            if self.by_keyword:
                out = self.func(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state, **columns)
            else:
                out = self.func(prompts, completions, completion_ids=completion_ids, trainer_state=state, **columns)
        except Exception as e:
            sys.stderr.write(f"--- traceback from your reward function {self.name} ---\n{user_traceback(e)}--- end ---\n")
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {first_line(e)} (its traceback is above)") from e
        return torch.tensor(self._values(out, len(completions)), dtype=torch.float32)

    def _values(self, out, n: int) -> list[float]:
        if getattr(out, "ndim", None) == 1 and hasattr(out, "tolist"):  # a 1-D tensor or array
            out = out.tolist()
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise RewardError(
                f"reward function {self.name} returned {kind(out)}, not a list of one reward per completion: return a list of {n} "
                "numbers (None for a completion it doesn't score)"
            )
        if len(out) != n:
            raise RewardError(
                f"reward function {self.name} returned {len(out)} values for {n} completions: return one reward (or None) per "
                "completion, in the order given"
            )
        values = []
        for i, v in enumerate(out):
            if v is None:
                values.append(math.nan)
                continue
            if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # a 0-d tensor or array, numpy's bool
                v = v.item()
            if not isinstance(v, numbers.Real):
                raise RewardError(
                    f"reward function {self.name} returned {kind(v)} ({repr(v)[:40]}) for completion {i} (counting from 0): return a "
                    "number, or None to leave it unscored"
                )
            x = float(v)
            if not math.isfinite(x) or abs(x) > F32_MAX:
                raise RewardError(
                    f"reward function {self.name} returned {x} for completion {i} (counting from 0): return a finite number (within "
                    "float32's range), or None to leave it unscored"
                )
            values.append(x)
        return values


@dataclass(frozen=True, eq=False)
class Rewards:
    """The run's reward functions and their weights (TRL's reward_weights: 1 each by default)."""

    functions: tuple[RewardFunction, ...]
    weights: torch.Tensor  # float32 [k]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.functions)

    def columns(self) -> dict[str, tuple[str, ...]]:
        """The data columns each function requires, by name: preflight can check the data has them."""
        return {f.name: f.columns for f in self.functions if f.columns}

    def fingerprint(self) -> str:
        """Identifies the functions for --resume: each one's name and the hash of the source it runs
        (the file's bytes as loaded, or its source text); another function or another version of its
        file gives another fingerprint."""
        return "; ".join(f"{f.name}={f.identity}" for f in self.functions)

    def changed_since(self, fingerprint: str) -> list[str]:
        """The functions (by name) that differ from those an earlier fingerprint() identified: added,
        removed, or another source."""
        before = dict(part.split("=", 1) for part in fingerprint.split("; ") if "=" in part)
        now = {f.name: f.identity for f in self.functions}
        return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))

    def score(self, prompts: list, completions: list, completion_ids: list | None, columns: dict[str, list], step: int) -> torch.Tensor:
        """[n completions, k functions] float32, NaN where a function returned None; each function
        called once with every completion. Raises RewardError when one fails."""
        kwargs = {k: v for k, v in columns.items() if k not in RESERVED}
        state = TrainerState(global_step=step)
        scores = torch.empty(len(completions), len(self.functions), dtype=torch.float32)
        for j, function in enumerate(self.functions):
            scores[:, j] = function(prompts, completions, completion_ids, kwargs, state)
        return scores


def unscorable(rewards_per_func: torch.Tensor) -> torch.Tensor:
    """[n] bool: completions every function left unscored (None); TRL gives them advantage 0."""
    return torch.isnan(rewards_per_func).all(dim=1)


# --- loading --------------------------------------------------------------------------------------------
def load_rewards(specs: Sequence[str | Callable], weights: Sequence[float] | None = None, extra: Sequence = ()) -> Rewards:
    """`--reward` specs (`path/to/file.py:func`, `package.module:func`) or the API's callables,
    loaded and checked; every problem is a one-line UserError naming the spec. `extra`: (function,
    identity) of rewards that come with the run's environments (their get_reward), weight 1 each,
    after the others (TRL's order)."""
    modules: dict = {}  # a file named by several specs is run once
    try:
        return build(specs or [], weights, modules, extra)
    except UserError:
        for module in modules.values():  # nothing of a refused --reward stays behind
            sys.modules.pop(module.__name__, None)
        raise


def build(specs, weights, modules: dict, extra: Sequence = ()) -> Rewards:
    if not specs and not extra:
        raise UserError("--objective grpo needs at least one --reward: a function f(prompts, completions, **kwargs) as file.py:func")
    loaded = [load_one(spec, i, modules) for i, spec in enumerate(specs)]
    if weights is not None and len(weights) != len(loaded):
        raise UserError(
            f"--reward-weights: {len(weights)} weights for {len(loaded)} reward functions; give one weight per function, in their order"
        )
    for i, w in enumerate(weights or ()):
        try:
            finite = math.isfinite(float(w))
        except (TypeError, ValueError):
            finite = False
        if not finite:
            raise UserError(f"--reward-weights: weight {i + 1} is {w!r}, not a finite number; give one finite number per function")
    loaded += [(func, f"the environment {callable_name(func)}'s get_reward", identity) for func, identity in extra]
    functions = []
    for spec, (func, culprit, identity), name in zip([*specs, *extra], loaded, unique_names([callable_name(f) for f, _, _ in loaded])):
        by_keyword, columns = call_style(func, culprit if isinstance(spec, str) else f"reward function {name}")
        functions.append(RewardFunction(func, name, identity, by_keyword, columns))
    given = [float(x) for x in weights] if weights is not None else [1.0] * len(specs)
    w = torch.tensor(given + [1.0] * len(extra), dtype=torch.float32)
    return Rewards(tuple(functions), w)


def unique_names(names: list[str]) -> list[str]:
    """Names as given, a repeated one suffixed _2, _3, ...: each function's metrics stay its own."""
    seen: set[str] = set()
    out = []
    for name in names:
        candidate, k = name, 1
        while candidate in seen:
            k += 1
            candidate = f"{name}_{k}"
        seen.add(candidate)
        out.append(candidate)
    return out


def load_one(spec, index: int, modules: dict) -> tuple[Callable, str, str]:
    """(the function, how errors name it, its identity for the fingerprint)."""
    if not isinstance(spec, str):
        if not callable(spec):
            raise UserError(
                f"reward function {index + 1} is {kind(spec)}, neither a function nor a 'file.py:func' spec; pass the function itself"
            )
        check_callable(spec, f"reward function {callable_name(spec)}")
        return spec, f"reward function {callable_name(spec)}", source_identity(spec)
    obj, culprit, identity = user_code.resolve(spec, "--reward", modules)
    if not callable(obj):
        target, _, attr = spec.rpartition(":")
        raise UserError(f"{culprit}: {attr} in {target} is {kind(obj)}, not a function; name a function f(prompts, completions, **kwargs)")
    check_callable(obj, culprit)
    return obj, culprit, identity


def check_callable(func, culprit: str) -> None:
    if inspect.isclass(func):
        raise UserError(f"{culprit}: {callable_name(func)} is a class; name a function, or pass an instance of it that has __call__")
    inner = func
    while isinstance(inner, partial):
        inner = inner.func
    if inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(type(inner).__call__):
        raise UserError(f"{culprit}: {callable_name(func)} is an async function; reward functions are called synchronously: make it a def")


def call_style(func, culprit: str) -> tuple[bool, tuple[str, ...]]:
    """(called by keyword, the data columns it requires). A function that names `prompts` or
    `completions` is called as TRL calls it, every argument by name; one that names neither gets
    them as its first two positional arguments. Its other parameters without a default are data
    columns; it must take **kwargs, since it is passed every column."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return True, ()  # no signature to check (a builtin): called as TRL calls it
    params = list(sig.parameters.values())
    shown = f"{callable_name(func)}{sig}"
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise UserError(
            f"{culprit}: {shown} takes no **kwargs, but every data column and trainer_state are passed to it by name; add **kwargs to "
            "its parameters"
        )
    for p in params:
        if p.name in ("prompt", "completion") and p.default is p.empty:
            raise UserError(f"{culprit}: {shown} takes {p.name!r}, which is never passed (TRL's name is {p.name}s); rename it {p.name}s")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names_them = "prompts" in sig.parameters or "completions" in sig.parameters
    by_keyword = names_them or (len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params))
    passed = {"prompts", "completions", "completion_ids", "trainer_state", "environments"}  # environments: with --environment, as TRL
    skip = passed | ({p.name for p in positional[:2]} if not by_keyword else set())
    columns = tuple(
        p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip
    )
    probe = {"completion_ids": [], "trainer_state": None, "environments": [], **{c: [] for c in columns}}
    try:
        sig.bind(prompts=[], completions=[], **probe) if by_keyword else sig.bind([], [], **probe)
    except TypeError as e:
        raise UserError(
            f"{culprit}: {shown} can't be called as f(prompts, completions, completion_ids=..., **kwargs) ({e}); name its first two "
            "parameters prompts and completions"
        ) from None
    return by_keyword, columns


# --- advantages -----------------------------------------------------------------------------------------
def nanstd(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd (trl.trainer.utils): the standard deviation ignoring NaNs, Bessel-corrected;
    NaN where fewer than two values count."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def advantages(
    rewards_per_func: torch.Tensor, weights, group_size: int, scale: str, names: Sequence[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """TRL's GRPO advantages (GRPOTrainer._generate_and_score_completions, multi_objective_aggregation
    "sum_then_normalize", TRL 1.16), from [n, k] scores whose rows are groups of `group_size`
    completions of one prompt: (advantages [n], weighted rewards [n] with NaN for unscorable rows,
    TRL's metrics + `zero_std_groups`). `zero_std_groups` [n / group_size] marks the groups with no
    signal: rewards that all tie (TRL's std isclose 0) or fewer than two scored completions; their
    advantages are 0 up to the rounding of TRL's mean (exactly 0 for a lone scored completion)."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, not {scale!r}")
    per_func = rewards_per_func.float()
    n, k = per_func.shape
    if n % group_size:
        raise ValueError(f"{n} completions do not split into groups of {group_size}")
    w = torch.as_tensor(weights, dtype=torch.float32, device=per_func.device)
    rewards = (per_func * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable(per_func)] = torch.nan
    mean_grouped = torch.nanmean(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0)
    group_std = nanstd(rewards.view(-1, group_size), dim=1) if group_size > 1 else torch.zeros(n // group_size, device=per_func.device)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # "none" uses the group std only to count the groups that tie
        std = group_std.repeat_interleave(group_size, dim=0)
    adv = rewards - mean_grouped
    if scale != "none":
        adv = adv / (std + EPSILON)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    adv = torch.nan_to_num(adv, nan=0.0)
    names = list(names) if names is not None else [f"func_{j}" for j in range(k)]
    stats: dict = {}
    for j, name in enumerate(names):
        stats[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, j]).item()
        stats[f"rewards/{name}/std"] = nanstd(per_func[:, j]).item()
    stats["reward"] = torch.nanmean(rewards).item()
    stats["reward_std"] = nanstd(rewards).item()
    stats["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    stats["zero_std_groups"] = torch.isclose(group_std, torch.zeros_like(group_std)) | torch.isnan(group_std)
    return adv, rewards, stats
