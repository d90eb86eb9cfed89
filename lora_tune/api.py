"""The Python API: the CLI's commands as functions, for notebooks and scripts.

Every function takes what the command takes: its positional arguments first (`eval`, `export` and
`check-serving` their SOURCE, `report` its RUN_DIR; `train`, `plan` and `merge` a YAML file or a dict,
their --config), a YAML file or a dict as `config`, and keyword options named as the YAML keys
(`max_seq_len=1024`), options winning over the file. Validation and messages
are the CLI's: bad input raises `lora_tune.UserError` with the same one-line message (`str(e)`), and
nothing calls `sys.exit`.

    plan = lora_tune.plan(base="llama-8b", precision="4bit", gpu_memory="t4")
    result = lora_tune.train(base="tiny-llama", data="examples/data/alpaca_demo.jsonl", output_dir="runs/demo", max_steps=30)
    model, tokenizer = lora_tune.load(result.adapter_dir)
    lora_tune.merge(adapter=result.adapter_dir, output="merged/demo")
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lora_tune.cli import quiet_libraries, setup_logging

quiet_libraries()  # before the libraries below load (bitsandbytes speaks at import); verbose=True undoes it

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from lora_tune import planner  # noqa: E402
from lora_tune.after import evaluation, reporting, serving  # noqa: E402
from lora_tune.after import export as exporting  # noqa: E402
from lora_tune.after import merge as merging  # noqa: E402
from lora_tune.after.merge.reading import latest_adapter, tokenizer_folder  # noqa: E402
from lora_tune.after.options import CheckServingConfig, EvalConfig, ExportConfig, MergeConfig, ReportConfig  # noqa: E402
from lora_tune.config import PlanConfig, TrainConfig  # noqa: E402
from lora_tune.engines import ranks  # noqa: E402
from lora_tune.engines import registry as engines  # noqa: E402
from lora_tune.errors import TrainingStopped, UserError, did_you_mean, first_line  # noqa: E402
from lora_tune.models.aliases import resolve_base  # noqa: E402
from lora_tune.models.loading import WEIGHT_DTYPE, load_config  # noqa: E402
from lora_tune.models.structure import auto_class  # noqa: E402
from lora_tune.options import build_config, read_yaml  # noqa: E402
from lora_tune.preflight import check_inputs  # noqa: E402
from lora_tune.training import launcher, recipe  # noqa: E402
from lora_tune.training.metrics import read_records  # noqa: E402

# How a stopped run is continued from Python, as the messages of a run started here say it.
RESUME_HOW = "the same lora_tune.train(...) call with resume=True"


@dataclass
class TrainResult:
    output_dir: Path
    adapter_dir: Path  # what PeftModel.from_pretrained and `merge` take
    steps: int
    final_loss: float | None
    eval_loss: float | None
    metrics: list[dict] = field(repr=False)  # every record of metrics.jsonl


def _config(schema, config, options: dict[str, Any], call: str):
    """The command's config from a YAML file or dict and keyword options; `call` names the function
    in messages (an unknown keyword gets the CLI's did-you-mean)."""
    for key in options:
        if key not in schema.model_fields:
            raise UserError(f"{call}: unknown option {key!r}{did_you_mean(key, schema.model_fields)}; the options are the YAML keys")
    if config is None:
        values, source = {}, "options"
    elif isinstance(config, dict):
        values, source = dict(config), "config"
    else:
        values, source = read_yaml(str(config)), str(config)
    return build_config(schema, values, {k: v for k, v in options.items() if v is not None}, source=source)


def _quiet(cfg) -> None:
    setup_logging()
    quiet_libraries(not cfg.verbose)


def train(config: str | Path | dict | None = None, callback=None, **options) -> TrainResult:
    """Train a LoRA adapter (`lora-tune train`). `callback(record)` gets every metrics record as it
    is written (e.g. `lora_tune.notebook.LivePlot()`; runs in this process only). With `nproc` (or a
    sharding backend) the ranks run as child processes, as on the command line. Raises UserError for
    bad input and `lora_tune.errors.TrainingStopped` when the run stops early (signal, repeated NaN,
    full disk), after it saved what it could. `reward` and `tools` (GRPO) take functions as well as
    their file.py:func names, `environment` classes (a dict {name: class}: picked per row by name)."""
    functions, tools = _callables(options, "reward"), _callables(options, "tools")
    environments = options.get("environment")
    given = list(environments.values()) if isinstance(environments, dict) else environments
    given = given if isinstance(given, list) else [given]
    if environments is None or all(isinstance(e, str) for e in given):
        environments = None
    else:  # recorded by name in the run's config, as functions are
        options["environment"] = [e if isinstance(e, str) else _name(e) for e in given]
    cfg = _config(TrainConfig, config, options, "lora_tune.train()")
    _quiet(cfg)
    if (cfg.nproc or engines.spec_of(cfg).multi_process) and not ranks.launched():
        if _checked(lambda: check_inputs(cfg)) is None:  # once, before the ranks start: bad input is one UserError here
            return _result(Path(cfg.output_dir).expanduser())
        # The ranks are `lora-tune train --config FILE` processes: the resolved options, in a file.
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump({k: v for k, v in cfg.model_dump().items() if k != "nproc"}, f)
        try:
            code = launcher.launch_job(cfg, ["train", "--config", f.name], RESUME_HOW)
        finally:
            os.unlink(f.name)
        if code != 0:
            raise TrainingStopped(f"the {cfg.nproc or 1}-process run ended with exit code {code} (its messages are above)", code, "error")
    else:
        inputs = _checked(lambda: check_inputs(cfg, functions, tools, environments))
        if inputs is None:
            return _result(Path(cfg.output_dir).expanduser())
        recipe.run(replace(inputs, resume_how=RESUME_HOW), on_metrics=callback)
    return _result(Path(cfg.output_dir).expanduser())


def _checked(check):
    """The input check's RunInputs, or None when it says the run is finished already (a resume with
    no step left, lora_tune.training.run_folder.check_steps_left): said, its result returned as it is."""
    try:
        return check()
    except TrainingStopped as done:
        if done.exit_code != 0:
            raise
        logging.getLogger("lora_tune").info("%s: %s", done.label, done)
        return None


def _name(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', obj)}"


def _callables(options: dict, key: str) -> list | None:
    """The API's functions given for a spec option (`reward`, `tools`), or None: recorded by name in
    the run's config (options[key]); the functions themselves run."""
    given = options.get(key)
    given = [given] if callable(given) else given
    if not given or not any(callable(f) for f in given):
        return None
    options[key] = [f if isinstance(f, str) else _name(f) for f in given]
    return given


def _result(out: Path) -> TrainResult:
    rows, _ = read_records(out / "metrics.jsonl")  # a line torn by a kill is no record
    losses = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]

    def number(v):
        return float(v) if v is not None else None

    return TrainResult(
        out,
        out,
        losses[-1]["step"] if losses else 0,
        number(losses[-1]["loss"]) if losses else None,
        number(evals[-1]["eval_loss"]) if evals else None,
        rows,
    )


def plan(config: str | Path | dict | None = None, **options):
    """Will it fit, and (auto=True) which setup is fastest (`lora-tune plan`): a `lora_tune.planner.Plan`
    with the numbers `--json` prints (`.to_json()`) and the table (`.text`)."""
    cfg = _config(PlanConfig, config, options, "lora_tune.plan()")
    return planner.compute(cfg)


def merge(config: str | Path | dict | None = None, **options) -> Path:
    """Fold an adapter into its full-precision base, verified (`lora-tune merge`); returns the folder."""
    cfg = _config(MergeConfig, config, options, "lora_tune.merge()")
    _quiet(cfg)
    return merging.run(cfg)


def report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """The run's curves as a PNG and its summary printed (`lora-tune report`); returns the PNG's path."""
    return reporting.run(ReportConfig(run_dir=str(run_dir), output=str(output) if output else None))


def load(path: str | Path, device: str | None = None, dtype: str = "bf16", trust_remote_code: bool = False):
    """(model, tokenizer), ready to generate: an adapter folder (the base it records, with the adapter
    on top, through peft) or a merged model folder. The model is in eval mode on `device` (default:
    the GPU when there is one)."""
    from peft import PeftModel  # noqa: PLC0415 - start-up time: importing peft costs seconds, only load() needs it

    from lora_tune.models.adapter import peft_building  # noqa: PLC0415 - the same (it imports peft)

    setup_logging()
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"{path} is not a folder; give an adapter folder written by train, or a merged model")
    folder = latest_adapter(folder)  # a run stopped before its final adapter: its latest checkpoint, said
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_ = WEIGHT_DTYPE.get(dtype, torch.bfloat16)
    hf_logging.disable_progress_bar()  # a bar per load in a notebook says nothing
    adapter_config = folder / "adapter_config.json"
    if adapter_config.is_file():
        try:
            base = json.loads(adapter_config.read_bytes()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError) as e:  # unreadable, not JSON, not an object
            raise UserError(f"{adapter_config} is unreadable or not an adapter config ({type(e).__name__}); re-save the adapter") from None
        if not base or not isinstance(base, str):
            raise UserError(f"{adapter_config} records no base model")
        base_path = resolve_base(base)
        auto = auto_class(load_config(base_path, trust_remote_code))  # image-text checkpoints load through their own class
        model = auto.from_pretrained(base_path, dtype=dtype_, trust_remote_code=trust_remote_code)
        with peft_building():
            model = PeftModel.from_pretrained(model, str(folder))
        tokenizer_dir = tokenizer_folder(folder, base_path)  # a checkpoint holds none: its run's, or the base's
    elif (folder / "config.json").is_file():
        auto = auto_class(load_config(str(folder), trust_remote_code))
        model = auto.from_pretrained(str(folder), dtype=dtype_, trust_remote_code=trust_remote_code)
        tokenizer_dir = folder
    else:
        raise UserError(f"{folder} holds neither an adapter (adapter_config.json) nor a model (config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # ValueError: no tokenizer files there, or files that are not one
        raise UserError(f"{tokenizer_dir}: could not load a tokenizer ({first_line(e)}); copy the base's tokenizer files there") from None
    return model.to(device).eval(), tokenizer


def _with_source(source, options: dict[str, Any], call: str) -> dict[str, Any]:
    """SOURCE given first, as on the command line (`lora-tune eval SOURCE`); a YAML file or dict of
    options goes in `config=`."""
    if source is None:
        return options
    if isinstance(source, dict) or Path(source).suffix.lower() in (".yaml", ".yml"):
        raise UserError(
            f"{call}: the first argument is SOURCE (a run or a merged folder), as on the command line; a config goes in config="
        )
    if "source" in options:
        raise UserError(f"{call}: SOURCE given twice (first argument and source=); give it once")
    return {**options, "source": str(source)}


def evaluate(source: str | Path | None = None, config: str | Path | dict | None = None, **options) -> dict:
    """Score a run (adapter through peft) or a merged model on lm-eval tasks (`lora-tune eval SOURCE`);
    returns what eval_results.json holds: {"adapter": {task: {metric: value}}, "base": {...} with
    base_too, "limit", "seconds", ...}."""
    cfg = _config(EvalConfig, config, _with_source(source, options, "lora_tune.evaluate()"), "lora_tune.evaluate()")
    _quiet(cfg)
    return evaluation.run(cfg)


def export(source: str | Path | None = None, config: str | Path | dict | None = None, **options):
    """Export a run or a merged folder to GGUF / a llama.cpp LoRA adapter / Ollama, verified
    (`lora-tune export SOURCE`); returns the round-trip figures (`.path`, `.max_rel_logit_diff`,
    `.greedy_agreement`, `.token_ids_equal`, `.seconds`)."""
    cfg = _config(ExportConfig, config, _with_source(source, options, "lora_tune.export()"), "lora_tune.export()")
    _quiet(cfg)
    return exporting.run(cfg)


def check_serving(source: str | Path | None = None, config: str | Path | dict | None = None, **options):
    """Will this adapter serve on vLLM / llama.cpp / Ollama (`lora-tune check-serving SOURCE`)? Returns a
    report with the serve command; raises UserError with every rule it breaks."""
    call = "lora_tune.check_serving()"
    cfg = _config(CheckServingConfig, config, _with_source(source, options, call), call)
    _quiet(cfg)
    return serving.run(cfg)
