"""A training run's output folder: what it may hold before a run starts, what `--resume` continues
from, and whether the checkpoint's math is the math asked for now. Checked before anything loads."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from lora_tune.engines import ranks as dist
from lora_tune.errors import UserError
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


def run_world_size(cfg: TrainConfig) -> int:
    """The number of processes this run trains with: the launcher's world inside a job, else the
    processes --nproc will start (or one)."""
    return dist.world_size() if dist.launched() else (cfg.nproc or 1)


def check_output_dir(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """The output folder, and the checkpoint to resume from (None for a fresh run)."""
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir: {out} is a file; give a folder")
    complete, incomplete = ckpt.list_checkpoints(out)
    if not dist.is_main():
        # Rank 0 judges the folder (and takes its lock) for the job; by the time another rank looks,
        # rank 0 may already have written this run's first files there.
        return out, complete[-1] if cfg.resume and complete else None
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


def check_resume_compatible(cfg: TrainConfig, data: PreparedData, checkpoint_dir: Path, base: str | None = None) -> dict:
    """The checkpoint's trainer state, when the math it was trained with is the math asked for now:
    the same settings, data content, base weights (by content: a base moved or renamed is the same
    base; one changed in place is not) and world size."""
    state = ckpt.read_trainer_state(checkpoint_dir / "trainer_state.json")
    saved = state.get("math_config", {})
    now = math_config(cfg)
    # A setting the checkpoint doesn't record (an option added since it was written) computed what
    # its default computes.
    missing = {k: field.default for k, field in type(cfg).model_fields.items() if k in now and k not in saved}
    differing = [k for k in sorted(set(saved) | set(now)) if saved.get(k, missing.get(k)) != now.get(k)]
    if state.get("data_fingerprint") != data.fingerprint:
        differing.append("data content (fingerprint)")
    if state.get("base_fingerprint") and base:
        if "base" in differing and state["base_fingerprint"] == base:
            differing.remove("base")  # the same weights under another name or path
        elif state["base_fingerprint"] != base:
            differing.append("base model content (config and weights' fingerprint)")
    if differing and not cfg.allow_config_change:
        details = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" if k in now else k for k in differing)
        raise UserError(
            f"--resume: the run in {checkpoint_dir.parent} was trained with other settings ({details}); restore them, or pass "
            "--allow-config-change"
        )
    if differing:
        log.warning("resuming with changed settings (--allow-config-change): %s", ", ".join(differing))
    check_world_size(cfg, state, checkpoint_dir)
    return state


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
