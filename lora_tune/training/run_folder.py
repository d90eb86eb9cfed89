"""A training run's output folder: what it may hold before a run starts, what `--resume` continues
from, and what of the configuration may change on resume. Checked before anything loads.

One rule for every restart: a resumed run's settings are the new configuration, decided here once.
Free settings (run length, cadence, reporting) just change; a math setting changes only with
--allow-config-change, and is then applied from the first resumed step (the engines rebuild the
optimizer's hyperparameters and the schedule from it); a fixed setting (what the checkpoint's state
is made of) is refused either way, with its reason. The README's table is `resume_table()`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from lora_tune.engines import ranks as dist
from lora_tune.errors import TrainingStopped, UserError
from lora_tune.files import writable_folder
from lora_tune.training import checkpoint as ckpt

if TYPE_CHECKING:
    from lora_tune.config import TrainConfig
    from lora_tune.data.prepare import PreparedData

log = logging.getLogger("lora_tune")


RUN_FILES = ("lora_tune_config.yaml", "adapter_config.json", "metrics.jsonl")


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


# A finished run whose checkpoints are gone: nothing to continue from, and its adapter must not be
# overwritten by a run from step 0. Formatted with out=OUTPUT_DIR.
FINISHED_RUN = (
    "--resume: {out} holds a finished run but no checkpoint to continue from (they were deleted), and resuming would "
    "start from step 0 over it; the adapter in {out} is complete; to train further, start a new run from it: "
    "--init-adapter {out} --output-dir NEW"
)


def math_config(cfg: TrainConfig) -> dict:
    return {k: getattr(cfg, k) for k in cfg.math_keys()}


def resume_table(schema) -> str:
    """What may change on --resume, as the README shows it: generated from the options' tags."""
    rules = schema.resume_rules()

    def names(kind: str, why: str | None = None) -> str:
        return ", ".join(f"`{n}`" for n, r in rules.items() if r.get("resume_rule") == kind and r.get("resume_why") == why)

    free = ", ".join(f"`{n}`" for n, r in rules.items() if r.get("resume_rule") == "free" and n not in ("resume", "allow_config_change"))
    reasons = dict.fromkeys(r["resume_why"] for r in rules.values() if r.get("resume_rule") == "fixed")
    return "\n".join(
        [
            "| on `--resume` | options | why |",
            "|---|---|---|",
            f"| may change | {free} | run length, cadence, speed and memory levers, reporting: the same math |",
            f"| change with `--allow-config-change`, applied from the first resumed step | {names('math')} | the checkpoint's state "
            "takes them: the optimizer's learning rate, weight decay and schedule are rebuilt from the new values over its restored "
            "moments (the schedule at the step reached); new data continues at the checkpoint's place in the new data's order |",
            *[f"| refused, `--allow-config-change` or not | {names('fixed', why)} | the checkpoint {why} |" for why in reasons],
            "| refused, `--allow-config-change` or not | the number of processes | each rank saved its own part of the optimizer "
            "state, and each step deals grad_accum x processes micro-batches |",
        ]
    )


def run_world_size(cfg: TrainConfig) -> int:
    """The number of processes this run trains with: the launcher's world inside a job, else the
    processes --nproc will start (or one)."""
    return dist.world_size() if dist.launched() else (cfg.nproc or 1)


def chosen_checkpoint(cfg: TrainConfig) -> Path | None:
    """`--resume CHECKPOINT`: the checkpoint folder named, checked to be one lora-tune completed
    (None for a plain --resume or a fresh run)."""
    if not isinstance(cfg.resume, str):
        return None
    path = Path(cfg.resume).expanduser()
    if not path.is_dir():
        raise UserError(f"--resume: {path} is not a folder; name a checkpoint folder (RUN/checkpoint-STEP), or pass --resume alone")
    if not ckpt.is_checkpoint_name(path.name):
        raise UserError(
            f"--resume: {path} is not a checkpoint folder (RUN/checkpoint-STEP); to continue a run from its newest checkpoint, pass "
            "--resume alone with --output-dir RUN"
        )
    if not (path / ckpt.MARKER).is_file() or not (path / "trainer_state.json").is_file():
        raise UserError(f"--resume: {path} is incomplete (no {ckpt.MARKER} marker or trainer_state.json): choose a complete checkpoint")
    holder = ckpt.lock_holder(path.parent)
    if holder and path.parent.resolve() != Path(cfg.output_dir).expanduser().resolve():
        raise UserError(f"--resume: {path.parent} is being written by another lora-tune run ({holder}); wait for it to end")
    return path


def check_output_dir(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """The output folder, and the checkpoint to resume from (None for a fresh run)."""
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir: {out} is a file; give a folder")
    chosen = chosen_checkpoint(cfg)
    complete, incomplete = ckpt.list_checkpoints(out)
    if not dist.is_main():
        # Rank 0 judges the folder (and takes its lock) for the job; by the time another rank looks,
        # rank 0 may already have written this run's first files there.
        return out, chosen or (complete[-1] if cfg.resume and complete else None)
    writable_folder(out, "--output-dir")
    links = sorted(p.name for p in out.iterdir() if p.is_symlink() and not ckpt.is_checkpoint_name(p.name)) if out.is_dir() else []
    if links:
        raise UserError(
            f"--output-dir: {out / links[0]} is a symbolic link; lora-tune never writes through links in its output folder (they "
            "could point at anyone's files): remove it, or choose another --output-dir"
        )
    odd = [name for name in (*RUN_FILES, *ADAPTER_FILES, ckpt.LOCK_NAME) if (out / name).exists() and not (out / name).is_file()]
    if odd:
        raise UserError(f"--output-dir: {out / odd[0]} is not a file (a folder?); lora-tune writes a file there: remove it")
    holder = ckpt.lock_holder(out)
    if holder:
        raise UserError(
            f"--output-dir: {out} is being written by another lora-tune run ({holder}); wait for it to end or choose another --output-dir"
        )
    holds_run = bool(complete or incomplete) or any((out / f).exists() for f in RUN_FILES)
    if chosen is not None and chosen.parent.resolve() != out.resolve():
        # Another run's checkpoint: continued in a folder of its own, the run it comes from untouched.
        if holds_run:
            raise UserError(
                f"--resume {chosen}: --output-dir {out} already holds a run; continue that one with --resume alone, or choose a new "
                "--output-dir for the run continued from the checkpoint"
            )
        return out, chosen
    if chosen is not None:
        newer = [p.name for p in complete if ckpt.step_of(p) > ckpt.step_of(chosen)]
        if newer:
            raise UserError(
                f"--resume {chosen}: {out} holds newer checkpoints ({', '.join(newer)}), which continuing in it would overwrite; "
                f"continue from {chosen.name} in a new folder: --resume {chosen} --output-dir NEW"
            )
        ckpt.remove_leftovers(out)
        return out, chosen
    if not cfg.resume:
        if holds_run:
            raise UserError(f"--output-dir: {out} already holds a run; pass --resume to continue it, or choose another --output-dir")
        return out, None
    if not complete:
        if all((out / f).is_file() for f in ADAPTER_FILES):
            raise UserError(FINISHED_RUN.format(out=out))
        ckpt.remove_leftovers(out)
        if holds_run or (out / ckpt.LOCK_NAME).is_file():  # the lock alone: killed while loading, before writing anything
            # Killed before its first checkpoint: there is nothing to lose, so start over.
            log.warning("no complete checkpoint in %s (%d incomplete ignored); starting from step 0", out, len(incomplete))
            return out, None
        raise UserError(f"--resume: no run to resume in {out}; start without --resume or point --output-dir at the run")
    leftovers = ckpt.remove_leftovers(out)
    if leftovers:
        log.info("removed %d temporary folder(s) left by an interrupted save", len(leftovers))
    newer_incomplete = [p.name for p in incomplete if ckpt.step_of(p) > ckpt.step_of(complete[-1])]
    if newer_incomplete:
        log.warning("ignoring incomplete checkpoint(s) %s (no %s marker)", ", ".join(newer_incomplete), ckpt.MARKER)
    return out, complete[-1]


def check_not_a_model(out: Path, base_path: str) -> None:
    """The output folder is never the base model's folder, nor inside it, nor another model's
    folder: a run writes its tokenizer and adapter files there, which would change what
    `from_pretrained` loads from it. Refused whatever the other options say."""
    base = Path(base_path)
    if base.is_dir():
        base, target = base.resolve(), out.resolve()
        if target == base or base in target.parents:
            where = "is the base model's folder" if target == base else f"is inside the base model's folder {base}"
            raise UserError(f"--output-dir: {out} {where}; a run writes its own files there. Choose a folder outside the base model")
    files = sorted(out.iterdir()) if out.is_dir() else []
    weights = [p.name for p in files if p.suffix in (".safetensors", ".bin") and not p.name.startswith("adapter_")]
    if (out / "config.json").is_file() and weights:
        raise UserError(
            f"--output-dir: {out} holds a model ({weights[0]}, config.json), not a lora-tune run; choose an empty folder or a "
            "new one for the run"
        )


def check_resume_settings(cfg: TrainConfig, checkpoint_dir: Path, base: str | None = None) -> dict:
    """The checkpoint's trainer state, when this configuration may continue it: no fixed setting
    changed; math settings and the base's content (a base moved or renamed is the same base, one
    changed in place is not) the same, or --allow-config-change; the same world size. What changes
    is recorded in the state's `config_changes` (carried into later checkpoints) and logged."""
    state = ckpt.read_trainer_state(checkpoint_dir / "trainer_state.json")
    saved = state.get("math_config", {})
    now = math_config(cfg)
    rules = cfg.resume_rules()
    # A setting the checkpoint doesn't record (an option added since it was written) computed what
    # its default computes.
    missing = {k: field.default for k, field in type(cfg).model_fields.items() if k in now and k not in saved}
    differing = {
        k: (saved.get(k, missing.get(k)), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k, missing.get(k)) != now.get(k)
    }
    fixed = [k for k in differing if rules.get(k, {}).get("resume_rule") == "fixed"]
    if fixed:
        why = "; ".join(f"{k}: {differing[k][0]!r} -> {differing[k][1]!r} (the checkpoint {rules[k]['resume_why']})" for k in fixed)
        if all(rules[k]["from_checkpoint"] for k in fixed):
            fix = f"start a new run from its adapter with the new settings: --init-adapter {checkpoint_dir} --output-dir NEW"
        else:
            fix = "a new adapter of another shape is a new run: leave out --resume and choose a new --output-dir"
        raise UserError(
            f"--resume: {checkpoint_dir} can't continue with {why}, --allow-config-change or not; resume with the checkpoint's "
            f"settings, or {fix}"
        )
    if state.get("base_fingerprint") and base:
        if "base" in differing and state["base_fingerprint"] == base:
            del differing["base"]  # the same weights under another name or path
        elif state["base_fingerprint"] != base:
            differing["base model content (config and weights' fingerprint)"] = (state["base_fingerprint"], base)
    if differing and not cfg.allow_config_change:
        details = "; ".join(f"{k}: {a!r} -> {b!r}" if k in now else k for k, (a, b) in differing.items())
        raise UserError(
            f"--resume: the run in {checkpoint_dir.parent} was trained with other settings ({details}); restore them, or pass "
            "--allow-config-change to continue with these (applied from the first resumed step)"
        )
    check_world_size(cfg, state, checkpoint_dir)
    if differing:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" if k in now else k for k, (a, b) in differing.items())
        log.warning(
            "resuming at step %d with changed settings (--allow-config-change), applied from step %d: %s",
            state["step"],
            state["step"] + 1,
            shown,
        )
        change = {"step": state["step"], "changed": {k: [a, b] for k, (a, b) in differing.items() if k in now}}
        state = {**state, "config_changes": [*state.get("config_changes", []), change]}
    return state


def check_resume_data(cfg: TrainConfig, state: dict, data: PreparedData, checkpoint_dir: Path) -> dict:
    """The data's content is the checkpoint's, or --allow-config-change continues on the new data
    (at the checkpoint's place, counted in micro-batches, in the new data's order)."""
    if state.get("data_fingerprint") == data.fingerprint:
        return state
    if not cfg.allow_config_change:
        raise UserError(
            f"--resume: the run in {checkpoint_dir.parent} was trained on other data (data content (fingerprint) differs); restore "
            "it, or pass --allow-config-change to continue on this data from the checkpoint's place in it"
        )
    log.warning("resuming on changed data (--allow-config-change): the run continues at its step on the new data's order")
    change = {"step": state["step"], "changed": {"data content (fingerprint)": [state.get("data_fingerprint"), data.fingerprint]}}
    return {**state, "config_changes": [*state.get("config_changes", []), change]}


def check_steps_left(cfg: TrainConfig, state: dict, total_steps: int, checkpoint_dir: Path, out: Path) -> None:
    """A resume that would train no step. Past the run's end: refused (exit 2). At its end: a run
    stopped while finishing (its final checkpoint written, then killed before its clean end, the
    adapter or tokenizer maybe half written) resumes to finish, writing the same adapter; a finished
    one is complete: nothing to do, exit 0 (a requeued job's --resume after the run ended), nothing
    written. Either way the run is left as it is (its config not rewritten)."""
    done = state["step"]
    if done < total_steps:
        return
    length = f"--max-steps {cfg.max_steps}" if cfg.max_steps else f"--epochs {cfg.epochs:g} ({total_steps} steps)"
    where = f"{checkpoint_dir} is at step {done}"
    if done == total_steps:
        if not all((out / f).is_file() for f in ADAPTER_FILES) or ckpt.left_by_a_stopped_run(out):
            log.info("%s, the end of the run: nothing to train; finishing the run, stopped before its end, from it", where)
            return
        raise TrainingStopped(
            f"{where}, the end of the run ({length}), and its adapter is written: nothing to train, nothing written; to train "
            f"further, raise {length.split()[0]}",
            0,
            "finished already",
        )
    raise UserError(
        f"--resume: {where}, past the {total_steps} steps {length} asks for: nothing to train; to train further, raise "
        f"{length.split()[0]}; for the adapter at an earlier step, take an earlier checkpoint folder (they are adapters too)"
    )


def check_world_size(cfg: TrainConfig, state: dict, checkpoint_dir: Path) -> None:
    """A resume is exact only with the world size the checkpoint was written with: each optimizer
    step is grad_accum x world micro-batches, dealt round-robin to the ranks, and every rank saved
    its own part of the optimizer state (split over the ranks by each multi-process backend), which
    can't be dealt out again to another number of ranks. So "provably the same" is: the same world
    size. Not overridable by --allow-config-change: the state itself would not match."""
    saved, now = int(state.get("world_size", 1)), run_world_size(cfg)
    if saved == now:
        return
    ga = cfg.grad_accum
    raise UserError(
        f"--resume: {checkpoint_dir} was written by {saved} process(es) and this run has {now}: each step would be {ga} x {now} "
        f"micro-batches instead of {ga} x {saved}, and each process saved its own shard of the optimizer state, which only "
        f"the same number of processes can load (the one case where a resume provably computes the same run). Resume with "
        f"--nproc {saved} (or launch {saved} processes)"
    )
