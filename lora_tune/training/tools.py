"""Tools and environments of agentic GRPO, as TRL 1.16's GRPOTrainer takes them (`tools=`,
`environment_factory`), loaded and checked before any model loads.

A tool is a plain function (sync or async) with type hints and a docstring with an `Args:` section:
transformers' `get_json_schema` turns it into the schema the chat template shows the model. An
environment is a class built with no arguments, one fresh instance per completion: `reset(**row)`
(the row's columns) returns text appended to the prompt's last user message (or None), its public
methods are tools bound to that instance, and an optional `get_reward()` (sync or async) scores the
episode as an extra reward function named after the class (weight 1). Several environments are
picked per row by an `environment` column (the class name; the API's dict: its key), and a `tools`
column of names narrows the run's tools per row.

A tool is the user's code running in the trainer's process: a call runs in a thread of its own and
is abandoned after --tool-timeout seconds (a thread can't be killed: one that never returns keeps
running beside the training, the model gets an error). A call that raises, times out, names an
unknown tool or passes arguments it doesn't take returns `{"error": "..."}` to the model, as TRL's
`_tool_call_loop` does, and is counted a failure; a result that isn't JSON-serialisable stops the run
naming the tool (a bug in it, as a reward function's non-number is).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from transformers.utils import get_json_schema

from lora_tune.errors import UserError, did_you_mean, first_line
from lora_tune.training import user_code
from lora_tune.training.rewards import RewardError
from lora_tune.training.user_code import callable_name, kind, source_identity

SPECIAL = ("reset", "get_reward")  # an environment's methods that are not tools
ENVIRONMENT_COLUMN, TOOLS_COLUMN = "environment", "tools"


class ToolError(RewardError):
    """A tool broke its contract while training (a result that isn't JSON): the run stops as it does
    for a failing reward function, in one line naming the tool."""


@dataclass(frozen=True, eq=False)
class Tool:
    name: str
    schema: dict  # what the chat template renders (transformers' get_json_schema)
    func: Callable | None  # None for an environment's method: bound to each episode's instance


@dataclass(frozen=True, eq=False)
class Environment:
    name: str  # what a row's `environment` column says to pick it
    cls: type
    tools: tuple[Tool, ...]  # its public methods
    reset: inspect.Signature  # reset's, without self
    rewarded: bool  # has get_reward
    identity: str


@dataclass
class Episode:
    """One completion's world: its environment instance (or None), the functions it may call by name,
    their schemas for the template, and what reset() said."""

    environment: object | None
    functions: dict[str, Callable]
    schemas: list[dict]
    observation: str | None = None
    counts: dict = field(default_factory=lambda: {"calls": 0, "failures": 0, "truncated": 0})


@dataclass(frozen=True, eq=False)
class Toolbox:
    tools: tuple[Tool, ...]
    environments: dict  # {name: Environment}; {None: Environment} for the one environment of every row
    identities: tuple[str, ...]  # of each tool, for the fingerprint

    @property
    def multi(self) -> bool:
        return None not in self.environments and bool(self.environments)

    def fingerprint(self) -> str:
        return "; ".join((*self.identities, *(e.identity for e in self.environments.values())))

    def check_rows(self, rows: Sequence[dict]) -> None:
        """Every row picks a known environment, names known tools, and has the columns its reset takes."""
        tools = {t.name for t in self.tools}
        for i, row in enumerate(rows):
            where = f"--data row {i + 1}"
            if not isinstance(row.get("prompt"), list):
                raise UserError(
                    f"{where}: tools need chat prompts (a list of {{role, content}} turns), not text; write the prompt as turns"
                )
            names = row.get(TOOLS_COLUMN)
            if names is not None:
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise UserError(f"{where}: the 'tools' column must list tool names (strings), got {kind(names)}")
                unknown = [n for n in names if n not in tools]
                if unknown:
                    raise UserError(
                        f"{where} names the tool {unknown[0]!r}, which --tools doesn't give{did_you_mean(unknown[0], tools)}; "
                        f"the tools: {', '.join(sorted(tools)) or 'none'}"
                    )
            if not self.environments:
                continue
            environment = self.environment_of(row, where)
            columns = {k: v for k, v in row.items() if not (self.multi and k == ENVIRONMENT_COLUMN)}
            try:
                environment.reset.bind(**columns)
            except TypeError as e:
                raise UserError(
                    f"--environment {environment.name}: reset(**row) can't take {where}'s columns ({', '.join(columns)}): {e}; give "
                    "reset the columns it needs as parameters and **kwargs for the others"
                ) from None

    def environment_of(self, row: dict, where: str) -> Environment | None:
        if not self.environments:
            return None
        if not self.multi:
            return self.environments[None]
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.environments:
            known = ", ".join(map(str, self.environments))
            what = "has no 'environment' column" if name is None else f"selects the environment {name!r}"
            raise UserError(
                f"{where} {what}, which is not among --environment's ({known}){did_you_mean(str(name), self.environments)}; "
                "give each row one of them"
            )
        return self.environments[name]

    def episode(self, row: dict) -> Episode:
        """A fresh world for one completion of `row`: a new environment instance, reset with the
        row's columns (TRL's order: the standalone tools, then the environment's methods)."""
        tools = [t for t in self.tools if row.get(TOOLS_COLUMN) is None or t.name in row[TOOLS_COLUMN]]
        functions = {t.name: t.func for t in tools}
        schemas = [t.schema for t in tools]
        environment = self.environment_of(row, "a --data row")
        if environment is None:
            return Episode(None, functions, schemas)
        instance = environment.cls()
        columns = {k: v for k, v in row.items() if not (self.multi and k == ENVIRONMENT_COLUMN)}
        observation = run_sync(instance.reset, columns)
        for tool in environment.tools:
            functions[tool.name] = getattr(instance, tool.name)
            schemas.append(tool.schema)
        return Episode(instance, functions, schemas, observation)

    def reward_functions(self) -> list[tuple[Callable, str]]:
        """TRL's get_reward rewards: one per environment class that has it, named after the class,
        scoring the completions of its own environment (None for the others): (function, identity)."""
        functions, seen = [], set()
        for environment in self.environments.values():
            if not environment.rewarded or environment.cls in seen:
                continue
            seen.add(environment.cls)

            def get_reward(prompts, completions, environments=None, _cls=environment.cls, **kwargs):
                return [run_sync(e.get_reward, {}) if type(e) is _cls else None for e in environments]

            get_reward.__name__ = get_reward.__qualname__ = environment.cls.__name__
            functions.append((get_reward, environment.identity))
        return functions


def run_sync(method, kwargs: dict):
    out = method(**kwargs)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


# --- loading ----------------------------------------------------------------------------------------
def load_toolbox(tools: Sequence | None, environments) -> Toolbox | None:
    """--tools and --environment specs (or the API's functions, classes, {name: class}), loaded and
    checked; None when neither is given. Every problem is one UserError naming the spec."""
    if not tools and not environments:
        return None
    modules: dict = {}
    loaded, identities = [], []
    for spec in tools or ():
        func, culprit, identity = load_tool(spec, modules)
        loaded.append(Tool(callable_name(func), tool_schema(func, culprit), func))
        identities.append(identity)
    if environments is not None and not isinstance(environments, (dict, list, tuple)):
        environments = [environments]  # one class (the API's)
    named = environments.items() if isinstance(environments, dict) else [(None, e) for e in environments or ()]
    envs = {}
    for name, spec in named:
        environment = load_environment(name, spec, modules)
        envs[environment.name] = environment
    if len(envs) == 1 and not isinstance(environments, dict):
        envs = {None: next(iter(envs.values()))}
    # The model calls tools by name: a name means one function in every episode.
    standalone = [t.name for t in loaded]
    clashes = {n for n in standalone if standalone.count(n) > 1} | {t.name for e in envs.values() for t in e.tools if t.name in standalone}
    if clashes:
        raise UserError(f"--tools: two tools are named {sorted(clashes)[0]!r} (in --tools, or an environment's method); rename one")
    return Toolbox(tuple(loaded), envs, tuple(identities))


def load_tool(spec, modules: dict) -> tuple[Callable, str, str]:
    if not isinstance(spec, str):
        if not callable(spec) or inspect.isclass(spec):
            raise UserError(f"tool {kind(spec)} is not a function; pass functions with type hints and a docstring (or file.py:func)")
        return spec, f"tool {callable_name(spec)}", source_identity(spec)
    func, culprit, identity = user_code.resolve(spec, "--tools", modules)
    if not callable(func) or inspect.isclass(func):
        raise UserError(f"{culprit}: {spec.rpartition(':')[2]} is {kind(func)}, not a function; name a function with type hints")
    return func, culprit, identity


def tool_schema(func, culprit: str) -> dict:
    """The tool's JSON schema as the chat template gets it; a function without type hints or a
    docstring describing each argument has none (the model would not know how to call it)."""
    try:
        return get_json_schema(func)
    except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise UserError(
            f"{culprit}: {first_line(e)}; a tool needs type hints on every argument and a docstring with a description and an "
            "Args: section naming each one (the model reads them)"
        ) from None


def load_environment(name: str | None, spec, modules: dict) -> Environment:
    if isinstance(spec, str):
        cls, culprit, identity = user_code.resolve(spec, "--environment", modules, what="class")
    else:
        cls, culprit = spec, f"environment {getattr(spec, '__name__', kind(spec))}"
        identity = source_identity(spec) if inspect.isclass(spec) else ""
    if not inspect.isclass(cls):
        raise UserError(f"{culprit}: {kind(cls)} is not a class; name a class with reset(**row) and its tools as methods")
    name = name if name is not None else cls.__name__
    if not callable(getattr(cls, "reset", None)):
        raise UserError(
            f"{culprit}: {cls.__name__} has no reset method; define reset(self, **row) -> str | None (it starts each episode, and "
            "what it returns is appended to the prompt)"
        )
    try:
        probe = cls()  # as TRL's environment_factory is called: no arguments
    except Exception as e:  # noqa: BLE001 - the user's constructor
        raise UserError(
            f"{culprit}: {cls.__name__}() raised {type(e).__name__}: {first_line(e)}; it must build with no arguments"
        ) from None
    tools = []
    for method_name, _ in inspect.getmembers(cls, predicate=inspect.isfunction):  # on the class: properties aren't evaluated
        if method_name in SPECIAL or method_name.startswith("_"):
            continue
        method = getattr(probe, method_name)
        tools.append(Tool(method_name, tool_schema(method, f"{culprit}: method {method_name}"), None))
    rewarded = callable(getattr(cls, "get_reward", None))
    if rewarded and inspect.signature(probe.get_reward).parameters:
        raise UserError(f"{culprit}: get_reward{inspect.signature(probe.get_reward)} takes arguments; TRL calls get_reward() with none")
    if not identity:
        identity = f"{cls.__module__}.{cls.__qualname__}"
    return Environment(name, cls, tuple(tools), inspect.signature(probe.reset), rewarded, f"{name}={identity}")


# --- calling ----------------------------------------------------------------------------------------
def call_tool(functions: dict[str, Callable], call: dict, timeout: float) -> tuple[str, object, bool]:
    """(the tool's name, its result or {"error": ...}, whether it failed) of one parsed call."""
    if call.get("type", "function") != "function":
        return call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}, True
    function = call["function"]
    name = function["name"]
    if name not in functions:
        return name, {"error": f"Tool {name} not found."}, True
    box: dict = {}

    def target():
        try:
            box["result"] = run_sync(functions[name], dict(function["arguments"]))
        except BaseException as e:  # noqa: BLE001 - whatever the user's tool raises goes back to the model
            box["error"] = e

    thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)  # daemon: one that hangs doesn't hold the exit
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return name, {"error": f"{name} did not return within {timeout:g} s (--tool-timeout)"}, True
    if "error" in box:
        return name, {"error": str(box["error"])}, True
    result = box.get("result")
    try:
        json.dumps(result)
    except (TypeError, ValueError):
        raise ToolError(
            f"tool {name} returned {kind(result)}, which isn't JSON-serialisable; return a str, number, bool, None, or lists and "
            "dicts of them"
        ) from None
    return name, result, False


def result_text(result) -> str:
    """What the tool message says: TRL's str(result) (a list as JSON: TRL's list results are
    multimodal parts, which text models don't take)."""
    return json.dumps(result) if isinstance(result, list) else str(result)
