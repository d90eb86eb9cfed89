"""`lora-tune` command line. Flags are generated from the typed config, so the YAML keys, the flags
and `--help` can never drift apart. Bad input ends in one `error:` line and exit code 2."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import types
import typing
import warnings
from typing import Any

from lora_tune import __version__
from lora_tune.after.options import CheckServingConfig, EvalConfig, ExportConfig, MergeConfig, ReportConfig
from lora_tune.config import PlanConfig, TrainConfig
from lora_tune.errors import TrainingStopped, UserError, first_line
from lora_tune.options import build_config, flag, read_yaml


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single `error:` line (no usage dump), exit code 2."""

    def error(self, message):
        print(f"error: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


def _unwrap(annotation):
    """(base type, is_list) for `X | None` / `list[X]` annotations."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def add_schema_flags(parser: argparse.ArgumentParser, schema, file_values: dict | None = None, file: str = "") -> None:
    """One flag per field, grouped in --help by the section that declares it (train's and plan's);
    defaults are SUPPRESSed so we know which flags were really given. `file_values`: what --config
    FILE sets, shown as the defaults (flags still win)."""
    groups = schema.sections() if hasattr(schema, "sections") else [(None, list(schema.model_fields))]
    for title, names in groups:
        group = parser.add_argument_group(f"{title} options") if title else parser
        for name in names:
            add_flag(group, name, schema.model_fields[name], (file_values or {}).get(name, NOT_IN_FILE), file)


NOT_IN_FILE = object()


def add_flag(parser, name: str, f, from_file=NOT_IN_FILE, file: str = "") -> None:
    kind, is_list = _unwrap(f.annotation)
    if from_file is not NOT_IN_FILE:
        default = f" (default: {from_file}, from {file})"
    else:
        default = "" if f.is_required() else f" (default: {f.default if f.default is not None else 'unset'})"
    help_text = (f.description or "") + default
    kw: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))
    if kind is bool:
        parser.add_argument(flag(name, f), action=argparse.BooleanOptionalAction, **kw)
        return
    value = (f.json_schema_extra or {}).get("flag_value")
    if value:  # a switch that may name what it acts on: --x alone is on, --x VALUE names it, --no-x off
        parser.add_argument(flag(name, f), nargs="?", const=True, type=str, metavar=value, **kw)
        off = dict(dest=name, action="store_false", default=argparse.SUPPRESS, help=f"{flag(name, f)} off")
        parser.add_argument("--no-" + flag(name, f).removeprefix("--"), **off)
        return
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        kw["metavar"] = "|".join(map(str, choices))
        kind = type(choices[0])  # validated by the schema, so the message is the same for YAML and flags
        if {"on", "off"} <= set(choices):  # a switch with more settings: --x alone is on, --no-x off
            parser.add_argument(flag(name, f), nargs="?", const="on", type=str, **kw)
            off = dict(dest=name, action="store_const", const="off", default=argparse.SUPPRESS, help=f"{flag(name, f)} off")
            parser.add_argument("--no-" + flag(name, f).removeprefix("--"), **off)
            return
    if is_list:
        kw["nargs"] = "+"
    if not isinstance(kind, type):  # e.g. a source: a string on the command line, a mapping only in YAML
        kind = str
    action = parser.add_argument(flag(name, f), type=kind, **kw)
    action.registry = (f.json_schema_extra or {}).get("registry")  # choices a registry holds: see RegistryHelp


class RegistryHelp(argparse.HelpFormatter):
    """--help whose choices for registry-backed options (--backend, --zero) are read from the engine
    registry when help is shown, so every registered backend appears, and commands that show no help
    never import the backends."""

    def _choices(self, action) -> dict | None:
        name = getattr(action, "registry", None)
        if not name:
            return None
        from lora_tune.engines import registry as engines  # noqa: PLC0415 - start-up time: the backends import torch and friends

        return getattr(engines, name)()

    def _metavar_formatter(self, action, default_metavar):
        choices = self._choices(action)
        if choices:
            return super()._metavar_formatter(action, "|".join(map(str, choices)))
        return super()._metavar_formatter(action, default_metavar)

    def _get_help_string(self, action):
        choices = self._choices(action)
        text = super()._get_help_string(action)
        return text + " Choices: " + "; ".join(f"{c}: {d}" for c, d in choices.items()).replace("%", "%%") if choices else text


def add_command(sub, name: str, schema, short: str, long: str, config_help: str = "YAML file with any of the options below", **kw):
    """A subcommand whose flags are `schema`'s fields, with --config FILE for the same keys in YAML;
    `source=True`: SOURCE may also be given positionally; `file_values` (with `file`): the --config
    file's values, shown by --help as the defaults."""
    source = kw.pop("source", False)
    file_values, file = kw.pop("file_values", None), kw.pop("file", "")
    command = sub.add_parser(name, help=short, description=long, **kw)
    if source:
        command.add_argument(
            "source_arg", nargs="?", metavar="SOURCE", default=argparse.SUPPRESS, help=schema.model_fields["source"].description
        )
    command.add_argument("--config", metavar="FILE", help=config_help)
    add_schema_flags(command, schema, file_values, file)


def build_parser(config: tuple[str, str, dict] | None = None) -> argparse.ArgumentParser:
    """`config`: (command, FILE, its values) of `COMMAND --config FILE --help`, whose --help shows the
    file's values as the defaults."""
    command_of, file, values = config or (None, "", {})

    def shown(name: str) -> dict:
        return {"file_values": values, "file": file} if name == command_of else {}

    parser = OneLineErrorParser(prog="lora-tune", description="Fine-tune large language models with LoRA on the GPUs you have.")
    parser.add_argument("--version", action="version", version=f"lora-tune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    sub.required = True

    add_command(
        sub,
        "train",
        TrainConfig,
        "train a LoRA adapter",
        "Train a LoRA adapter. Every option is also a key of the --config YAML file (flags win).",
        "YAML file with any of the options below (keys use underscores, e.g. max_seq_len)",
        formatter_class=RegistryHelp,
        **shown("train"),
    )
    add_command(
        sub,
        "merge",
        MergeConfig,
        "merge an adapter into its full-precision base",
        "Fold a LoRA adapter into the full-precision base weights, shard by shard, and verify the result.",
        **shown("merge"),
    )
    add_command(
        sub,
        "plan",
        PlanConfig,
        "will it fit, and which setup is fastest",
        "Estimate memory per GPU and host from config.json alone (no weights), or --auto search the fastest setup "
        "that fits. Takes every train option, so a training --config plans as it is.",
        "YAML file (a training config works)",
        formatter_class=RegistryHelp,
        **shown("plan"),
    )
    sub.add_parser("models", help="list the model aliases", description="List the built-in model aliases.")
    report = sub.add_parser(
        "report",
        help="plot a run's metrics",
        description="Plot loss, eval loss, learning rate, tokens/s and memory over steps (PNG) and print a summary.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help=ReportConfig.model_fields["run_dir"].description)
    report.add_argument("--output", default=argparse.SUPPRESS, help=ReportConfig.model_fields["output"].description)
    add_command(
        sub,
        "eval",
        EvalConfig,
        "score a run or merged model on lm-eval tasks",
        "Score a run (adapter through peft) or a merged model on lm-evaluation-harness tasks; --base-too puts the base "
        "beside it. Results go to SOURCE/eval_results.json.",
        source=True,
        **shown("eval"),
    )
    add_command(
        sub,
        "export",
        ExportConfig,
        "export to GGUF (llama.cpp), a llama.cpp LoRA adapter, or Ollama",
        "Write a run (merged on the fly, streaming) or a merged folder as GGUF, a llama.cpp LoRA adapter GGUF, or an "
        "Ollama folder (GGUF + Modelfile); read back and verified before it is put in place.",
        source=True,
        **shown("export"),
    )
    add_command(
        sub,
        "check-serving",
        CheckServingConfig,
        "will vLLM / llama.cpp / Ollama serve this adapter",
        "Check an adapter against a serving engine's rules (each with its source) and print how to serve it; refused "
        "adapters get one line with the alternative.",
        source=True,
        **shown("check-serving"),
    )
    return parser


def config_from_args(schema, args: argparse.Namespace, skip=("command", "config")):
    flags = {k: v for k, v in vars(args).items() if k not in skip}
    file_values = read_yaml(args.config) if getattr(args, "config", None) else {}
    return build_config(schema, file_values, flags, source=args.config or "config")


def cmd_models() -> int:
    from lora_tune.models.aliases import ALIASES, architecture  # noqa: PLC0415 - start-up time: each command loads only its own modules
    from lora_tune.planner.architecture import Architecture  # noqa: PLC0415 - start-up time: each command loads only its own modules

    names = max(len("alias"), *(len(a.name) for a in ALIASES.values()))  # columns as wide as their longest entry
    hub_ids = max(len("hub id"), *(len(a.hub_id) for a in ALIASES.values()))
    print(f"{'alias':<{names}} {'hub id':<{hub_ids}} {'params':>8}  description")
    for a in ALIASES.values():
        params = Architecture.from_config(architecture(a.name)).total  # exact: counted on a meta skeleton
        size = f"{params / 1e9:>7.2f}B" if params >= 1e8 else f"{params / 1e6:>7.2f}M"
        print(f"{a.name:<{names}} {a.hub_id:<{hub_ids}} {size}  {a.description}")
    return 0


def setup_logging() -> None:
    """Our messages go to the stderr of this call (re-bound each time, for notebooks and tests)."""
    logger = logging.getLogger("lora_tune")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    # In multi-process runs only rank 0 reports; the others speak up for warnings and errors.
    logger.setLevel(logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING)
    logger.propagate = False


NOISY_LIBRARIES = (
    "transformers",
    "peft",
    "bitsandbytes",
    "kernels",
    "deepspeed",
    "DeepSpeed",
    "accelerate",
    "datasets",
    "torch",
    "trl",
    "gguf",
    "lm_eval",
    "lm-eval",
)


def quiet_libraries(quiet: bool = True) -> None:
    """Hide the libraries' own warnings and info logs (deprecations inside transformers, optional
    kernels bitsandbytes could not find, DeepSpeed's start-up chatter): they are about nothing the
    user did. Our own messages (logger `lora_tune`) are untouched; --verbose (quiet=False) shows
    everything again."""
    pattern = "|".join(NOISY_LIBRARIES)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore" if quiet else "default", category=category, module=rf"({pattern})(\.|$)")
    # peft's notes on its own bookkeeping: the rank_pattern / alpha_pattern it adds for fused MoE experts,
    # then finds unmatched (Qwen3-Next's shared expert). What it adapted is checked exactly
    # (lora_tune.models.targets.check_adapted), so they say nothing about the run.
    warnings.filterwarnings("ignore" if quiet else "default", category=RuntimeWarning, module=r"peft(\.|$)")
    for name in NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.ERROR if quiet else logging.NOTSET)
    if quiet:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DATASETS_VERBOSITY", "error")


def without_flags(argv: list[str], *names: str) -> list[str]:
    """argv less the named flags and their values (`--flag V` or `--flag=V`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not a.startswith(tuple(f"{n}=" for n in names)):
            out.append(a)
    return out


def continue_command(argv: list[str]) -> str:
    """The command that continues this run from its newest checkpoint: argv with --resume alone (a
    checkpoint it named is behind the run by then; `train` takes no positional after a flag)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--resume" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            i += 1  # its CHECKPOINT
        elif not (a == "--resume" or a.startswith("--resume=")):
            out.append(a)
        i += 1
    return "lora-tune " + shlex.join([*out, "--resume"])


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - start-up time: each command loads only its own modules

    from lora_tune.engines import ranks  # noqa: PLC0415 - start-up time: each command loads only its own modules
    from lora_tune.engines import registry as engines  # noqa: PLC0415 - start-up time: each command loads only its own modules
    from lora_tune.preflight import check_inputs  # noqa: PLC0415 - start-up time: each command loads only its own modules
    from lora_tune.training import launcher, recipe  # noqa: PLC0415 - start-up time: each command loads only its own modules

    hf_logging.disable_progress_bar()  # our own progress bar is the one that matters
    cfg = config_from_args(TrainConfig, args)
    if (cfg.nproc or engines.spec_of(cfg).multi_process) and not ranks.launched():
        # Validate once here, in one line, before starting N processes that would each fail.
        # Its summaries (data, memory plan) are left to rank 0, which prints them again.
        logging.getLogger("lora_tune").setLevel(logging.WARNING)
        check_inputs(cfg)
        return launcher.launch_job(cfg, without_flags(argv, "--nproc"), continue_command(argv))
    if os.environ.get(launcher.LAUNCHER_ENV, "").isdigit():  # a rank of our --nproc launcher: stop when it dies
        launcher.stop_with_parent(int(os.environ[launcher.LAUNCHER_ENV]))
    try:
        recipe.run(check_inputs(cfg))
    except TrainingStopped as stop:
        print(f"{stop.label}: {stop}", file=sys.stderr)
        return stop.exit_code
    except Exception as e:
        if not launcher.lost_peer(e):
            raise
        # Another rank died (killed, crashed): this one can't go on. Under our launcher the
        # launcher says what happened, once; under torchrun each rank says it here.
        if launcher.LAUNCHER_ENV not in os.environ:
            print(
                f"error: rank {ranks.rank()} lost contact with the other ranks ({first_line(e)[:200]}); resume with --resume",
                file=sys.stderr,
            )
        return launcher.LOST_PEER_EXIT
    return 0


def help_config(argv: list[str]) -> tuple[str, str, dict] | None:
    """For `COMMAND --config FILE --help`: (command, FILE, the file's values), so that --help shows
    what this command would run with; None otherwise."""
    if not {"-h", "--help"} & set(argv):
        return None
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("command", nargs="?")
    first.add_argument("--config")
    known, _ = first.parse_known_args(argv)
    if not known.config or not known.command:
        return None
    return known.command, known.config, read_yaml(known.config)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging()
    # The `deepspeed` launcher appends --local_rank=N; LOCAL_RANK in the environment says the
    # same (torchrun and accelerate set only that), so the flag is dropped.
    argv = without_flags([str(a) for a in (sys.argv[1:] if argv is None else argv)], "--local_rank", "--local-rank")
    if "--verbose" not in argv:  # before parsing: --help imports the backends (and their libraries' chatter)
        quiet_libraries()
    try:
        config = help_config(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    args = build_parser(config).parse_args(argv)
    try:
        if args.command == "models":
            return cmd_models()
        if args.command == "train":
            return cmd_train(args, argv)
        if args.command == "report":
            from lora_tune.after import reporting  # noqa: PLC0415 - start-up time: each command loads only its own modules

            reporting.run(ReportConfig(**{k: v for k, v in vars(args).items() if k in ReportConfig.model_fields}))
            return 0
        if args.command == "plan":
            from lora_tune import planner  # noqa: PLC0415 - start-up time: each command loads only its own modules

            return planner.run(config_from_args(PlanConfig, args))
        if args.command == "merge":
            from lora_tune.after import merge  # noqa: PLC0415 - start-up time: each command loads only its own modules

            merge.run(config_from_args(MergeConfig, args))
            return 0
        if args.command in ("eval", "export", "check-serving"):
            if hasattr(args, "source_arg"):  # SOURCE given positionally (the --source flag says the same)
                args.source = args.__dict__.pop("source_arg")
            if args.command == "eval":
                from lora_tune.after import evaluation  # noqa: PLC0415 - start-up time: each command loads only its own modules

                evaluation.run(config_from_args(EvalConfig, args))
            elif args.command == "export":
                from lora_tune.after import export  # noqa: PLC0415 - start-up time: each command loads only its own modules

                export.run(config_from_args(ExportConfig, args))
            else:
                from lora_tune.after import serving  # noqa: PLC0415 - start-up time: each command loads only its own modules

                serving.run(config_from_args(CheckServingConfig, args))
            return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except TrainingStopped as stop:  # a signal during the data stage or a merge: stopped cleanly
        print(f"{stop.label}: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 2


def entry() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    entry()
