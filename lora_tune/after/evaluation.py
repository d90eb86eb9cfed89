"""`lora-tune eval`: benchmark scores of a fine-tune through lm-evaluation-harness, base and adapter
side by side ("did my fine-tune make the model worse at everything else?").

The adapter is applied through peft by lm-eval itself (`HFLM(pretrained=BASE, peft=ADAPTER)`), so no
merge is needed; a merged folder is scored as a plain model. Tasks come from lm-eval's registry or
from task YAMLs in --include (with local data files this works offline). Results go to
SOURCE/eval_results.json, which `lora-tune report` plots beside the training curves.

lm_eval is an optional extra (`pip install "lora-tune[eval]"`): imported inside the functions, so the
rest of lora-tune neither needs it nor pays its start-up time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lora_tune.after.merge.reading import latest_adapter, read_adapter
from lora_tune.after.outputs import check_output, is_model, written_by_us
from lora_tune.after.serving import read_config
from lora_tune.engines import registry as engines
from lora_tune.errors import UserError, did_you_mean, first_line
from lora_tune.files import writable_folder
from lora_tune.models import shards
from lora_tune.models.aliases import resolve_base

if TYPE_CHECKING:
    from lora_tune.config import TrainConfig

log = logging.getLogger("lora_tune")
RESULTS_FILE = "eval_results.json"


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401, PLC0415 - optional dependency (the [eval] extra)
    except ImportError:
        raise UserError('eval: lm-evaluation-harness is missing; pip install "lora-tune[eval]" (or pip install lm-eval)') from None


# lm-eval's registry takes ~6 s to build: it indexes the ~14,700 task files it ships. Tasks that are
# all defined under --include are looked up in that folder's registry alone (lm-eval's
# include_defaults=False), which builds at once; each registry is built once per process for each
# state of --include (its task files' contents), so a notebook's or a script's second evaluation starts
# at once and an added, edited or removed task file is indexed anew.
TASK_MANAGERS: dict[tuple, object] = {}


def task_manager(include: str | None, tasks: list[str] = ()):
    """lm-eval's registry, plus the task YAMLs under `include` (only those, when `tasks` are all
    tasks defined there: no group or tag, which may name lm-eval's own)."""
    if include is not None and not Path(include).expanduser().is_dir():
        raise UserError(f"--include: {include} is not a folder; give the folder holding your task YAML files")
    folder = str(Path(include).expanduser().resolve()) if include else None
    if folder and tasks:
        local = registry(folder, defaults=False)
        if set(tasks) <= set(local.all_subtasks):
            return local
    return registry(folder, defaults=True)


def registry(folder: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 - optional dependency (the [eval] extra)

    key = (folder, defaults, task_files(Path(folder)) if folder else ())
    if key not in TASK_MANAGERS:
        TASK_MANAGERS[key] = TaskManager(include_path=folder, include_defaults=defaults)
    return TASK_MANAGERS[key]


def task_files(folder: Path) -> tuple:
    """(relative path, digest of the content) of every YAML file under `folder`: what lm-eval indexes
    (the data files it names are read when a task is built)."""
    state = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml")):
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as e:  # a dangling link, a folder: lm-eval says what it makes of it
            digest = type(e).__name__
        state.append((str(path.relative_to(folder)), digest))
    return tuple(state)


def check_tasks(manager, tasks: list[str]) -> None:
    """Every task known before any model is loaded; an unknown one is one line with a suggestion."""
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known and not manager.match_tasks([task]):
            raise UserError(
                f"--tasks: {task} is not an lm-eval task{did_you_mean(task, known)}; "
                "see `lm-eval ls tasks`, or define it in a YAML file under --include"
            )


def check_task_definitions(manager, tasks: list[str]) -> None:
    """Every task built once (its YAML read, its data loaded) before any model is: a task YAML of
    --include that lm-eval can't build (cut short, a field it refuses) is one line naming it, not an
    error from inside lm-eval after the model loaded."""
    from lm_eval.tasks import get_task_dict  # noqa: PLC0415 - optional dependency (the [eval] extra)

    with stderr_silenced(True):  # lm-eval's notes on building tasks
        for task in tasks:
            try:
                get_task_dict([task], manager)
            except Exception as e:  # noqa: BLE001 - lm-eval raises many types for a task it can't build
                raise UserError(f"--tasks: lm-eval can't build the task {task} ({first_line(e)[:200]}); fix its YAML or its data") from None


def metrics_of(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's {"results": {task: {"acc,none": v, "acc_stderr,none": e, "alias": ...}}} ->
    {task: {"acc": v, "acc_stderr": e}} (numbers only, filter suffix dropped when it is "none")."""
    out = {}
    for task, values in results.get("results", {}).items():
        row = {}
        for key, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filt = key.partition(",")
            row[metric if filt in ("", "none") else f"{metric},{filt}"] = float(value)
        out[task] = row
    return out


def run_tasks(
    model,
    tokenizer,
    tasks: list[str],
    limit: float | None = None,
    include: str | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    manager=None,
    quiet: bool = True,
) -> dict[str, dict[str, float]]:
    """Score an in-memory model (a PeftModel too) on lm-eval tasks: {task: {metric: value}}.

    The training-time hook for --eval-tasks calls this at each evaluation with the model being
    trained (in eval mode, under no_grad: lm-eval only runs forward passes)."""
    require_lm_eval()
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415 - optional dependency (the [eval] extra)

    manager = manager or task_manager(include, tasks)
    check_tasks(manager, tasks)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return evaluate(lm, tasks, limit, num_fewshot, manager, quiet)


def evaluate(lm, tasks: list[str], limit, num_fewshot, manager, quiet: bool) -> dict[str, dict[str, float]]:
    """lm-eval's simple_evaluate on a loaded model: {task: {metric: value}}. It records the git commit
    of the working folder with `git describe`, which writes to our stderr: outside a repository git
    says 'fatal: not a git repository' into the command's output (at every --eval-tasks evaluation).
    `quiet` (no --verbose): the stderr file descriptor points at /dev/null for the call; lm-eval's own
    logs are at ERROR already, and its failures arrive as exceptions."""
    from lm_eval import simple_evaluate  # noqa: PLC0415 - optional dependency (the [eval] extra)

    with stderr_silenced(quiet):
        results = simple_evaluate(
            model=lm,
            tasks=tasks,
            limit=limit,
            num_fewshot=num_fewshot,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=0,
            verbosity="ERROR",
        )
    return metrics_of(results or {})


@contextmanager
def stderr_silenced(active: bool):
    """File descriptor 2 (what child processes inherit) pointed at /dev/null while the block runs."""
    if not active:
        yield
        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def flat_metrics(scores: dict[str, dict[str, float]], prefix: str = "eval_tasks") -> dict[str, float]:
    """{task: {metric: v}} -> {"eval_tasks/task/metric": v}: one metrics.jsonl record's keys, logged like eval loss."""
    return {f"{prefix}/{task}/{metric}": v for task, row in scores.items() for metric, v in row.items() if not metric.endswith("_stderr")}


def _score_path(pretrained: str, peft_dir: str | None, cfg, manager) -> dict[str, dict[str, float]]:
    """lm-eval loads the model itself (with the adapter through peft when given)."""
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415 - optional dependency (the [eval] extra)

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": "bfloat16" if device.startswith("cuda") else "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[
        cfg.dtype
    ]
    lm = HFLM(
        pretrained=pretrained, peft=peft_dir, device=device, dtype=dtype, batch_size=cfg.batch_size, trust_remote_code=cfg.trust_remote_code
    )
    return evaluate(lm, cfg.tasks, cfg.limit, cfg.num_fewshot, manager, not cfg.verbose)


def run(cfg) -> dict:
    """`lora-tune eval SOURCE --tasks T1,T2 [--limit N] [--base-too]`: writes eval_results.json and
    prints base vs adapter side by side; returns what it wrote."""
    require_lm_eval()
    given = Path(cfg.source).expanduser()
    if not given.is_dir():
        raise UserError(f"{cfg.source} does not exist; give a training run's --output-dir or a merged model folder")
    source = latest_adapter(given)
    adapter_config = source / "adapter_config.json"
    if adapter_config.is_file():
        config, _ = read_adapter(source, "eval")  # a damaged adapter is one line here, not peft's error once the base is loaded
        base = cfg.base or config.get("base_model_name_or_path")
        if not base:
            raise UserError(f"--base: {adapter_config} records no base; pass --base")
        base_path, peft_dir = resolve_base(base), str(source)
    elif (source / "config.json").is_file():
        if cfg.base_too and not cfg.base:
            raise UserError("--base-too: a merged folder does not record its base; pass --base too")
        base_path, peft_dir = (resolve_base(cfg.base) if cfg.base else None), None
    else:
        raise UserError(f"{source} holds neither an adapter (adapter_config.json) nor a model (config.json)")
    if not cfg.output and is_model(given) and not written_by_us(given):  # a base (or a hub snapshot): nothing is written into it
        raise UserError(f"--output: {given} is a model lora-tune did not write, and eval writes nothing into it; pass --output FILE.json")
    local_base = {"base model": Path(base_path)} if base_path and Path(base_path).is_dir() else {}
    output = check_output(cfg.output or given / RESULTS_FILE, "eval", folder=False, replaces=True, inputs=local_base, ours=is_results)
    writable_folder(output.parent, "--output")
    check_model_files(base_path if peft_dir else str(source), "--base" if peft_dir else "eval")
    if cfg.base_too:
        check_model_files(base_path, "--base")
    manager = task_manager(cfg.include, cfg.tasks)
    check_tasks(manager, cfg.tasks)
    check_task_definitions(manager, cfg.tasks)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    record: dict = {"source": str(source), "tasks": cfg.tasks, "limit": cfg.limit, "num_fewshot": cfg.num_fewshot, "seconds": {}}
    shown = "" if cfg.verbose else " (lm-eval's progress bars: --verbose)"
    what = ("the adapter" if peft_dir else str(source)) + (" and the base" if cfg.base_too else "")
    log.info("eval: scoring %s on %s%s", what, ", ".join(cfg.tasks), shown)
    t0 = time.perf_counter()
    record["adapter" if peft_dir else "model"] = _score_path(base_path if peft_dir else str(source), peft_dir, cfg, manager)
    record["seconds"]["adapter" if peft_dir else "model"] = round(time.perf_counter() - t0, 2)
    if cfg.base_too:
        t0 = time.perf_counter()
        record["base"] = _score_path(base_path, None, cfg, manager)
        record["seconds"]["base"] = round(time.perf_counter() - t0, 2)
        record["base_model"] = base_path
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, output)  # never a half-written results file
    print(table(record))
    print(f"results: {output}")
    return record


def _cell(scores: dict, task: str, metric: str) -> str:
    """One score with its standard error, as the side-by-side table shows it."""
    v = scores.get(task, {}).get(metric)
    err = scores.get(task, {}).get(f"{metric}_stderr")
    if v is None:
        return f"{'-':>16}"
    return f"{v:>9.4f}" + (f" ({err:.3f})" if err is not None and not math.isnan(err) else " " * 8)


def table(record: dict) -> str:
    """Base vs adapter side by side (stderr in brackets when lm-eval computed it)."""
    tuned_key = "adapter" if "adapter" in record else "model"
    tuned, base = record[tuned_key], record.get("base")
    header = f"{'task':<24} {'metric':<14} " + (f"{'base':>16} " if base else "") + f"{tuned_key:>16}" + ("  delta" if base else "")
    lines = [header]
    for task, row in tuned.items():
        for metric, value in row.items():
            if metric.endswith("_stderr") or metric == "sample_len":
                continue

            line = f"{task:<24} {metric:<14} " + (_cell(base, task, metric) + " " if base else "") + _cell(tuned, task, metric)
            if base and base.get(task, {}).get(metric) is not None:
                line += f"  {value - base[task][metric]:+.4f}"
            lines.append(line)
    seconds = record.get("seconds", {})
    lines.append(
        "wall time: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
        + (f" (limit {record['limit']:g} per task)" if record.get("limit") else "")
    )
    return "\n".join(lines)


def check_model_files(folder: str, option: str) -> None:
    """A local model's config.json and safetensors headers, read before lm-eval loads it (where a
    damaged file is a library's error); a hub id's files are the hub's."""
    path = Path(folder)
    if not path.is_dir():
        return
    read_config(path / "config.json", option)
    if shards.shard_files(path) is not None:
        shards.read_headers(path)
    elif os.path.lexists(path / shards.SINGLE):  # there, but not a file: a dangling link, a folder
        shards.read_header(path / shards.SINGLE)


def is_results(path: Path) -> bool:
    """A results file `eval` wrote (the only kind it replaces in a run's folder)."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "tasks" in record and ("adapter" in record or "model" in record)


def read_results(run_dir: Path) -> dict | None:
    path = run_dir / RESULTS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def task_scorer(cfg: TrainConfig):
    """--eval-tasks, checked before training: the task names now, and a model sharded over several
    processes is scored after training instead (`lora-tune eval`). Returns what the loop calls at
    each evaluation, `(peft model, tokenizer) -> metrics record`, or None."""
    if not cfg.eval_tasks:
        return None
    if engines.spec_of(cfg).multi_process:
        raise UserError(
            f"--eval-tasks scores the model in one process; with --backend {engines.backend_name(cfg)} leave it out and run "
            "`lora-tune eval OUTPUT_DIR --tasks ...` after training"
        )
    require_lm_eval()
    manager = task_manager(cfg.eval_tasks_include, cfg.eval_tasks)
    check_tasks(manager, cfg.eval_tasks)
    check_task_definitions(manager, cfg.eval_tasks)

    def score(peft_model, tokenizer) -> dict[str, float]:
        scores = run_tasks(peft_model, tokenizer, cfg.eval_tasks, cfg.eval_tasks_limit, cfg.eval_tasks_include, quiet=not cfg.verbose)
        return flat_metrics(scores)

    return score
