"""Everything about the user's input, checked before a single weight is loaded: the backend cell,
the output folder and what to resume, the base and its tokenizer, the LoRA targets and speed levers
for this model, the whole dataset, the resume compatibility, and the memory plan.

`check_inputs(cfg)` returns a frozen `RunInputs`: the recipe only ever reads it. The `--nproc`
launcher runs it too, so a bad input fails once, in one line, before any process starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from lora_tune import planner
from lora_tune.after import evaluation, serving
from lora_tune.config import TrainConfig
from lora_tune.data.batching import MicroBatches
from lora_tune.data.cache import cache_root as data_cache_root
from lora_tune.data.prepare import PreparedData, prepare_data
from lora_tune.data.prompts import read_eval_prompts
from lora_tune.engines import ranks as dist
from lora_tune.engines import registry as engines
from lora_tune.errors import UserError
from lora_tune.models import shards
from lora_tune.models.adapter import Checkpointing, Inventory, Targets, check_loads_back, peft_exact_targets, resolve_targets
from lora_tune.models.aliases import resolve_base
from lora_tune.models.head import chunking_refusal
from lora_tune.models.loading import (
    attention_implementation,
    checkpointing_refusal,
    dequantizing,
    head_refusal,
    load_config,
    load_tokenizer,
    packing_refusal,
    pick_device,
    quant_method,
)
from lora_tune.models.structure import meta_model, model_class
from lora_tune.planner.architecture import unquantized_experts
from lora_tune.planner.memory import GIB, Estimate, Setup, recomputed_layers
from lora_tune.planner.search import BUDGET_SHARE, fewest_checkpointed
from lora_tune.planner.speed import checkpointing_cost
from lora_tune.training import checkpoint as ckpt
from lora_tune.training import compilation
from lora_tune.training.metrics import check_reporter
from lora_tune.training.objectives import registry as objectives
from lora_tune.training.objectives.registry import Objective

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


@dataclass(frozen=True)
class SpeedLevers:
    """Packing, the chunked loss and the attention kernels as they apply to this model and machine."""

    packing: bool
    loss_chunk_size: int | None  # None: per micro-batch (auto); 0: the model's own full-logits loss
    attention: str


@dataclass(frozen=True)
class ReferencePlan:
    """The reference policy's log-probabilities: computed before training ("precompute", kept in
    `cache` when the data cache is on, and in the run folder) or in every step ("per-step")."""

    mode: str
    cache: Path | None


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of this run, kept for what an out-of-memory stop prints."""

    estimate: Estimate
    setup: Setup
    device_bytes: int


@dataclass(frozen=True)
class RunInputs:
    """The checked inputs of one run, fully built before anything heavy is loaded."""

    cfg: TrainConfig
    output_dir: Path
    resume_from: Path | None  # the checkpoint to continue from
    saved_state: dict | None  # its trainer_state.json
    base_path: str  # what from_pretrained takes
    base_id: str  # what the adapter records as its base
    base_fingerprint: str | None  # of its config and safetensors headers (None: a hub id not in the local cache)
    tokenizer: object
    device: torch.device
    targets: Targets | None  # None: remote code, resolved on the loaded model
    levers: SpeedLevers
    data: PreparedData
    eval_prompts: list[list[int]]
    batches: MicroBatches
    total_steps: int
    plan: MemoryPlan | None  # None when the architecture can't be read offline
    objective: Objective
    reference: ReferencePlan | None  # how the reference log-probabilities are computed (objectives that compare with one)
    checkpointing: Checkpointing  # which decoder layers recompute their activations


def math_config(cfg: TrainConfig) -> dict:
    return {k: getattr(cfg, k) for k in TrainConfig.math_keys()}


def run_world_size(cfg: TrainConfig) -> int:
    """The number of processes this run trains with: the launcher's world inside a job, else the
    processes --nproc will start (or one)."""
    return dist.world_size() if dist.launched() else (cfg.nproc or 1)


def total_steps(cfg: TrainConfig, micro_batches_per_epoch: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * micro_batches_per_epoch / (cfg.grad_accum * dist.world_size())))


def writable_folder(out: Path, option: str) -> None:
    """Refuse, before anything is loaded, an output folder that can't be created or written: one
    under a file, on a read-only file system or without write permission. Writes nothing."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{option}: {out} would be inside {existing}, which is a file; give a folder")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise UserError(f"{option}: {existing} is on a read-only file system; choose another {option}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {existing} is not writable (permission denied); choose another {option}")


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


def base_fingerprint(cfg: TrainConfig, base_path: str) -> str | None:
    """Checks the base's weights before loading and returns what identifies them: its config.json
    and each safetensors file's name, size and header (validated against the file's size, so a
    truncated or garbage shard is named now). A hub id is looked up in the local cache; None when
    it isn't there yet (from_pretrained will download it)."""
    folder = Path(base_path)
    if not folder.is_dir():
        cached = try_to_load_from_cache(base_path, "config.json")
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent
        files = shards.shard_files(folder)
        if files is None or not all(p.is_file() for p in files):
            return None  # not all downloaded yet: from_pretrained fetches the rest
    if shards.shard_files(folder) is None:
        bins = sorted(folder.glob("*.bin"))
        if not bins or not cfg.allow_bin:
            return None  # the loader names what is missing (or asks for --allow-bin)
        return shards.fingerprint(folder, bins)
    return shards.fingerprint(folder)


def check_resume_compatible(cfg: TrainConfig, data: PreparedData, checkpoint_dir: Path, base: str | None = None) -> dict:
    """The checkpoint's trainer state, when the math it was trained with is the math asked for now:
    the same settings, data content, base weights (by content: a base moved or renamed is the same
    base; one changed in place is not) and world size."""
    state = ckpt.read_trainer_state(checkpoint_dir / "trainer_state.json")
    saved = state.get("math_config", {})
    now = math_config(cfg)
    differing = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
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


def lora_targets(cfg: TrainConfig, config) -> Targets | None:
    """--target-modules resolved on a meta skeleton of the model (shapes only, no weights), so a
    bad name or an unsupported combination fails before loading; what is adapted is logged."""
    if model_class(config) is None:
        return None  # remote code: resolved on the loaded model
    skeleton = meta_model(config)
    inventory = Inventory.of(skeleton)
    if inventory.tied and not cfg.target_modules:
        log.warning(
            "LoRA targets: %s left out: their weights are tied across layers (one tensor in the checkpoint), so LoRA on them "
            "could not be merged",
            ", ".join(inventory.tied),
        )
    targets = peft_exact_targets(config, cfg, resolve_targets(inventory, cfg))
    check_loads_back(config, cfg, targets)
    log.info("LoRA targets: %s", targets.describe(skeleton))
    fused = sum(p.numel() for p in skeleton.parameters() if p.dim() == 3)
    note = unquantized_experts(cfg.precision, fused, sum(p.numel() for p in skeleton.parameters()))
    if note:
        log.warning(note)
    return targets


def speed_levers(cfg: TrainConfig, config, device: torch.device) -> SpeedLevers:
    """Packing, the chunked loss, activation offload and the attention kernels, checked against
    this model and machine from its config alone; what can't apply says so in one line."""
    attention = attention_implementation(cfg, config, device)
    packing = cfg.packing
    reason = packing_refusal(config) if cfg.packing else None
    if reason:
        log.warning("packing off: %s; training on padded batches instead (pass --no-packing to silence this)", reason)
        packing = False
    chunk = cfg.loss_chunk_size
    reason = chunking_refusal(config) or head_refusal(config) if chunk != 0 else None
    if reason:
        log.warning("chunked loss off: %s, which the chunked loss does not reproduce; computing the full logits instead", reason)
        chunk = 0
    if cfg.activation_offload and cfg.gradient_checkpointing == "off":
        raise UserError("--activation-offload moves the inputs that gradient checkpointing keeps: it needs --gradient-checkpointing")
    if cfg.activation_offload and device.type != "cuda":
        raise UserError(f"--activation-offload needs a CUDA GPU (on {device} the activations already live in host memory); leave it out")
    reason = compilation.toolchain_refusal(device) if cfg.compile else None
    if reason:
        raise UserError(f"--compile: {reason}")
    chunks = "full logits" if chunk == 0 else f"chunked ({chunk or 'auto'} tokens per chunk)"
    compiled = ""
    if cfg.compile:
        compiled = "; decoder layers " + ("" if chunk == 0 else "and the loss's chunk step ") + "compiled (regional torch.compile)"
    log.info("attention: %s; packing %s; loss %s%s", attention, "on" if packing else "off", chunks, compiled)
    return SpeedLevers(packing, chunk, attention)


def check_eval_tasks(cfg: TrainConfig) -> None:
    """--eval-tasks scores the model in this process with lm-eval: the task names are checked now,
    and a model sharded over several processes is scored after training instead (`lora-tune eval`)."""
    if not cfg.eval_tasks:
        return
    if engines.spec_of(cfg).multi_process:
        raise UserError(
            f"--eval-tasks scores the model in one process; with --backend {engines.backend_name(cfg)} leave it out and run "
            "`lora-tune eval OUTPUT_DIR --tasks ...` after training"
        )
    evaluation.require_lm_eval()
    evaluation.check_tasks(evaluation.task_manager(cfg.eval_tasks_include), cfg.eval_tasks)


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU runs live in host RAM


def auto_checkpointing(cfg: TrainConfig, arch, setup: Setup, device: torch.device) -> Setup:
    """--gradient-checkpointing auto: the fewest checkpointed layers whose plan fits the budget
    (--memory-budget, else the GPU's memory less 10%). A CPU has no device budget: the fewest whose
    plan needs no more than checkpointing every layer (the last layer keeps its activations: backward
    reaches it first, and rebuilding it would take the same memory)."""
    if cfg.memory_budget is not None:
        budget, source = int(cfg.memory_budget * GIB), f"--memory-budget {cfg.memory_budget:g} GiB"
    elif device.type == "cuda":
        budget = int(BUDGET_SHARE * device_memory_bytes(device))
        source = f"{BUDGET_SHARE:.0%} of {device_memory_bytes(device) / GIB:.1f} GiB"
    else:
        budget = planner.estimate(arch, replace(setup, gradient_checkpointing=True, kept_layers=0)).per_device["total_bytes"]
        source = f"the {budget / GIB:.2f} GiB of checkpointing every layer: no device memory budget on {device}, --memory-budget sets one"
    chosen = fewest_checkpointed(arch, setup, budget)
    need = planner.estimate(arch, chosen).per_device["total_bytes"] / GIB
    recomputed = recomputed_layers(arch, chosen)
    gain = 1 - checkpointing_cost(chosen, arch.layers) / checkpointing_cost(setup, arch.layers)
    log.info(
        "gradient checkpointing (auto): %d of %d decoder layers recomputed, the rest keep their activations (plan %.2f GiB "
        "within %s; step time %.0f%% below checkpointing every layer)",
        recomputed,
        arch.layers,
        need,
        source,
        100 * gain,
    )
    return chosen


def preflight(cfg: TrainConfig, device: torch.device):
    """The memory plan for this run, before loading: a warning (or with --strict-memory an error)
    when it will not fit. None when the architecture can't be read offline."""
    try:
        arch = planner.load_architecture(cfg.base)
    except UserError as e:
        log.info("memory plan skipped: %s", e)
        return None
    setup = planner.setup_from(cfg)
    if cfg.gradient_checkpointing == "auto":
        setup = auto_checkpointing(cfg, arch, setup, device)
    estimate = planner.estimate(arch, setup)
    need, have = estimate.per_device["total_bytes"], device_memory_bytes(device)
    log.info("memory plan: %.2f GiB of %.2f GiB on %s", need / GIB, have / GIB, device)
    if need > have:
        message = (
            f"the memory plan needs {need / GIB:.1f} GiB but {device} has {have / GIB:.1f} GiB; "
            "run `lora-tune plan --auto` with these options for a setup that fits"
        )
        if cfg.strict_memory:
            raise UserError(f"--strict-memory: {message}")
        log.warning("warning: %s", message)
    return MemoryPlan(estimate, setup, have)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def reference_plan(cfg: TrainConfig, objective: Objective, data: PreparedData, base: list, trained: int, per_epoch: int):
    """Where this run's reference log-probabilities come from, said in the log. Keyed for the cache
    by what they depend on: the data, the base (its id and content fingerprint), the starting
    adapter, the compute precision."""
    if not objective.reference:
        return None
    if cfg.init_adapter and cfg.reference == "per-step":
        raise UserError(
            "--reference per-step disables the adapter to get the reference, which with --init-adapter is not the starting "
            "model; use --reference precompute (or auto)"
        )
    cache = None
    if cfg.data_cache:
        adapter = file_digest(Path(cfg.init_adapter).expanduser() / "adapter_model.safetensors") if cfg.init_adapter else None
        key = hashlib.sha256(json.dumps([data.fingerprint, *base, adapter, cfg.precision, cfg.max_seq_len]).encode()).hexdigest()[:24]
        cache = data_cache_root(cfg) / "reference" / f"{key}.safetensors"
    mode = objectives.reference_mode(cfg, objective, trained, per_epoch, cached=cache is not None and cache.is_file())
    why = {
        "precompute": "one pass over the data before training" + (" (cached for later runs)" if cache is not None else ""),
        "per-step": "a forward with the adapter disabled in every step",
    }[mode]
    if cfg.reference != "auto":
        why += f" (--reference {cfg.reference})"
    elif mode == "per-step":
        why += " (this run scores fewer units than the data holds, and none are cached)"
    log.info("reference for %s: %s", objective.name, "from the cache" if mode == "precompute" and cache and cache.is_file() else why)
    return ReferencePlan(mode, cache)


def check_init_adapter(cfg: TrainConfig, targets: Targets | None) -> None:
    """--init-adapter: an adapter folder whose shape is this run's (rank, alpha, targets, variants)."""
    if not cfg.init_adapter:
        return
    folder = Path(cfg.init_adapter).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise UserError(f"--init-adapter: {folder} is not an adapter folder (needs adapter_config.json and adapter_model.safetensors)")
    try:
        saved = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--init-adapter: {config_file} is unreadable ({e})") from None
    if not isinstance(saved, dict):
        raise UserError(f"--init-adapter: {config_file} is not an adapter config")
    wanted = {"r": cfg.rank, "lora_alpha": cfg.lora_alpha, "use_rslora": cfg.rslora, "use_dora": cfg.dora}
    if targets is not None:
        wanted["target_modules"] = targets.peft_target_modules()
    defaults = {"use_rslora": False, "use_dora": False}  # peft's, for configs written without them
    found = {k: saved.get(k, defaults.get(k)) for k in wanted}
    if isinstance(found.get("target_modules"), list) and isinstance(wanted.get("target_modules"), list):
        found["target_modules"], wanted["target_modules"] = sorted(found["target_modules"]), sorted(wanted["target_modules"])

    def shown(v):
        return f"{v:g}" if isinstance(v, float) else repr(v)

    differing = [f"{k} {shown(found[k])} (this run: {shown(wanted[k])})" for k in wanted if found[k] != wanted[k]]
    if differing:
        raise UserError(
            f"--init-adapter: {folder} has {'; '.join(differing)}; pass the options it was trained with (e.g. --rank "
            f"{saved.get('r')} --alpha {saved.get('lora_alpha')})"
        )


def check_inputs(cfg: TrainConfig) -> RunInputs:
    engines.check_compatibility(cfg)
    objectives.check_options(cfg)
    check_reporter(cfg.report_to)
    base_path = resolve_base(cfg.base)
    base_id = base_path if not Path(base_path).is_dir() else str(Path(base_path).resolve())
    check_not_a_model(Path(cfg.output_dir).expanduser(), base_path)
    output_dir, resume_from = check_output_dir(cfg)
    fingerprint = base_fingerprint(cfg, base_path)
    tokenizer = load_tokenizer(base_path, cfg.trust_remote_code)
    device = pick_device()
    config = load_config(base_path, cfg.trust_remote_code)
    engines.check_layer_by_layer(cfg, quant_method(config))
    dequantizing(config, cfg.precision)  # a pre-quantized checkpoint that can't be trained this way: one line now
    reason = checkpointing_refusal(config) if cfg.gradient_checkpointing != "off" else None
    if reason and cfg.gradient_checkpointing == "on":
        raise UserError(f"--gradient-checkpointing on: {reason}; use --gradient-checkpointing off (or auto)")
    if reason:
        log.warning(
            "gradient checkpointing off: %s; every layer's activations are kept (pass --gradient-checkpointing off to silence this)",
            reason,
        )
        cfg = cfg.model_copy(update={"gradient_checkpointing": "off"})
    targets = lora_targets(cfg, config)
    check_init_adapter(cfg, targets)
    serving.check_config(cfg, targets, config.model_type)
    check_eval_tasks(cfg)
    levers = speed_levers(cfg, config, device)
    eval_prompts = read_eval_prompts(cfg.eval_prompts, tokenizer, cfg.system_message) if cfg.eval_prompts else []
    data = prepare_data(cfg, tokenizer)
    for line in data.per_source if len(data.per_source) > 1 else []:
        log.info("data source %s", line)
    log.info("data: %s format, %s; %d train / %d eval samples", data.format, data.stats.summary(), len(data.train), len(data.eval))
    saved_state = check_resume_compatible(cfg, data, resume_from, fingerprint) if resume_from else None
    objective = objectives.of(cfg)
    row = cfg.max_seq_len * objective.sequences_per_unit  # a unit's sequences travel in one row
    batches = MicroBatches(data.train.lengths, cfg.micro_batch_size, cfg.seed, levers.packing, cfg.group_by_length, row)
    if levers.packing:
        tokens = sum(data.train.lengths)
        log.info(
            "packing: %d samples in %d rows of up to %d tokens (%.0f%% full)",
            len(data.train),
            batches.n_rows,
            row,
            100 * tokens / (batches.n_rows * row),
        )
    steps = total_steps(cfg, len(batches))
    plan = preflight(cfg, device)
    reference = reference_plan(cfg, objective, data, [base_id, fingerprint], steps * cfg.grad_accum * dist.world_size(), len(batches))
    return RunInputs(
        cfg=cfg,
        output_dir=output_dir,
        resume_from=resume_from,
        saved_state=saved_state,
        base_path=base_path,
        base_id=base_id,
        base_fingerprint=fingerprint,
        tokenizer=tokenizer,
        device=device,
        targets=targets,
        levers=levers,
        data=data,
        eval_prompts=eval_prompts,
        batches=batches,
        total_steps=steps,
        plan=plan,
        objective=objective,
        reference=reference,
        checkpointing=Checkpointing(plan.setup.gradient_checkpointing, plan.setup.kept_layers) if plan else Checkpointing.of(cfg),
    )
