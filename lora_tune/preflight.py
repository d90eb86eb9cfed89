"""`lora-tune train`'s front door: every input checked before a single weight is loaded, by the room
that owns it, in the order a user would fix them: the backend cell (engines), the objective's
options, the output folder and what to resume (training), the base, its tokenizer, LoRA targets and
what the model supports (models), serving and evaluation rules (after), the speed levers, the whole
dataset (data), the resume compatibility and the memory plan (planner).

`check_inputs(cfg)` returns a frozen `lora_tune.training.inputs.RunInputs`, which the recipe and the
loop only ever read. The CLI and the API run it before starting `--nproc` ranks too, so a bad input
fails once, in one line, before any process starts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial
from pathlib import Path

import torch
from pydantic import ValidationError

from lora_tune.after import evaluation, serving
from lora_tune.config import TrainConfig
from lora_tune.data.batching import PASS_TOKENS, MicroBatches
from lora_tune.data.prepare import prepare_data
from lora_tune.data.prompts import read_eval_prompts
from lora_tune.engines import ranks as dist
from lora_tune.engines import registry as engines
from lora_tune.errors import UserError
from lora_tune.models import data_inits, inits, tiled_mlp
from lora_tune.models.adapter import Checkpointing, check_init_adapter
from lora_tune.models.adapter_types import registry as adapter_types
from lora_tune.models.aliases import resolve_base
from lora_tune.models.attention import quadratic_attention_warning
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
from lora_tune.models.options import LORA_INITS
from lora_tune.models.processors import ImageText, load_image_text
from lora_tune.models.shards import base_fingerprint
from lora_tune.models.structure import is_image_text
from lora_tune.models.targets import lora_targets, token_ids
from lora_tune.planner.run_plan import memory_plan
from lora_tune.training import compilation
from lora_tune.training.episodes import check_template
from lora_tune.training.generation import registry as generation
from lora_tune.training.inputs import RunInputs, SpeedLevers
from lora_tune.training.metrics import check_reporter
from lora_tune.training.objectives import registry as objectives
from lora_tune.training.objectives.reference import reference_plan
from lora_tune.training.rewards import load_rewards
from lora_tune.training.rollout import check_reward_columns, steps_per_epoch
from lora_tune.training.run_folder import (
    check_not_a_model,
    check_output_dir,
    check_resume_data,
    check_resume_settings,
    check_steps_left,
    run_world_size,
)
from lora_tune.training.tools import load_toolbox

log = logging.getLogger("lora_tune")


def total_steps(cfg: TrainConfig, micro_batches_per_epoch: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    data_parallel = max(1, dist.world_size() // cfg.sequence_parallel)  # a sequence-parallel group trains one share of the rows
    return max(1, math.ceil(cfg.epochs * micro_batches_per_epoch / (cfg.grad_accum * data_parallel)))


def unplanned_tiles(cfg: TrainConfig, config) -> int:
    """--tiled-mlp without a memory plan (the architecture can't be read offline): on tiles, auto doesn't."""
    if cfg.tiled_mlp != "on":
        return 0
    row = math.ceil(cfg.max_seq_len / cfg.sequence_parallel)
    return tiled_mlp.tile_count(row, config.get_text_config(decoder=True).hidden_size)


def check_rewards_unchanged(cfg: TrainConfig, rewards, saved_state: dict | None) -> dict | None:
    """A resumed GRPO run scores with the functions it started with: another function (or another
    version of its file) trains another objective from the checkpoint on. Refused by default; with
    --allow-config-change (a bug fixed in a reward, the common case) the new ones score from the
    first resumed step, said in the log and recorded in the state's config changes."""
    saved = (saved_state or {}).get("rewards_fingerprint")
    if saved is None or saved == rewards.fingerprint():
        return saved_state
    changed = ", ".join(rewards.changed_since(saved)) or "their files"
    if not cfg.allow_config_change:
        raise UserError(
            f"--resume: the reward functions changed since the checkpoint was written ({changed}); resume with the ones it was "
            "trained with, or pass --allow-config-change to score with these from the first resumed step (a fixed bug, say)"
        )
    log.warning(
        "resuming with changed reward functions (--allow-config-change), scoring from step %d: %s", saved_state["step"] + 1, changed
    )
    change = {"step": saved_state["step"], "changed": {"reward functions": changed}}
    return {**saved_state, "config_changes": [*saved_state.get("config_changes", []), change]}


def check_adapter(cfg: TrainConfig) -> None:
    """The adapter (--peft-type, --init-lora-weights) against the precision, backend and objective: one
    line where they can't go together (also what the compatibility matrix's adapter table shows)."""
    objective = objectives.of(cfg)
    spec = engines.spec_of(cfg)
    partitioned = cfg.zero == 3 or spec.loads_layer_by_layer(cfg.precision, cfg.zero)
    adapter_types.check(cfg, whole_gradients=spec.whole_gradients)
    needs_reference = objective.reference or bool(objective.online and cfg.beta)
    inits.check(cfg, needs_reference=needs_reference, partitioned=partitioned, online=objective.online)


# The compatibility matrix's adapter table (docs/reference/matrix.md, and the runs of its accepted
# cells in tests/engines/test_sharded_runs.py): its setups, one row per LoRA init and adapter type.
ADAPTER_SETUPS = {  # column -> the options that select it
    "one device": {},
    "DDP": {"backend": "ddp", "nproc": 2},
    "ZeRO-1/2": {"zero": 2, "nproc": 2},
    "ZeRO-3": {"zero": 3, "nproc": 2},
    "FSDP2": {"backend": "fsdp", "nproc": 2},
    "4-bit, one device": {"precision": "4bit"},
    "4-bit, FSDP2": {"precision": "4bit", "backend": "fsdp", "nproc": 2},
}


@dataclasses.dataclass(frozen=True)
class AdapterCell:
    """One cell of the adapter table: the row's options under the column's setup, and why `train`
    refuses it (None: accepted). `name` / `placeholder`: the row's own name, and what a shared
    refusal note writes in its place (INIT, TYPE)."""

    row: str
    column: str
    options: dict
    refusal: str | None
    name: str | None = None
    placeholder: str = ""


def adapter_cells() -> list[AdapterCell]:
    rows = {"LoRA (peft's init)": ({}, None, "")}
    for init in (i for i in LORA_INITS if i != "pissa_niter_N"):
        rows[f"LoRA `--init-lora-weights {init.replace('_', '-')}`"] = ({"init_lora_weights": init}, init, "INIT")
    for name in (n for n in adapter_types.TYPES if n != "lora"):
        rows[f"`--peft-type {name}`"] = ({"peft_type": name}, name, "TYPE")
    cells = []
    for row, (options, name, placeholder) in rows.items():
        for column, setup in ADAPTER_SETUPS.items():
            refusal = None
            try:
                check_adapter(TrainConfig(base="base", data=["data.jsonl"], output_dir="out", **{"precision": "bf16", **setup, **options}))
            except ValidationError as e:  # an option's own check (an init refused whatever the setup)
                refusal = e.errors()[0]["msg"].removeprefix("Value error, ")
            except UserError as e:
                refusal = str(e)
            cells.append(AdapterCell(row, column, {**setup, **options}, refusal, name, placeholder))
    return cells


def pass_tokens(cfg: TrainConfig, device: torch.device) -> int | None:
    """Padded tokens per forward + backward pass when a micro-batch runs in several (a CPU, one process,
    data on disk: lora_tune.data.batching.passes), else None. The sharding backends count micro-steps
    themselves, and online objectives build their own batches."""
    objective = objectives.of(cfg)
    check_adapter(cfg)
    row = cfg.max_seq_len * objective.sequences_per_unit
    tokens = max(PASS_TOKENS, row)
    if device.type != "cpu" or engines.spec_of(cfg).multi_process or objective.online or cfg.micro_batch_size * row <= tokens:
        return None
    return tokens


def speed_levers(cfg: TrainConfig, config, device: torch.device) -> SpeedLevers:
    """Packing, the chunked loss, activation offload, the attention kernels and the passes per
    micro-batch, checked against this model and machine from its config alone; what can't apply
    says so in one line."""
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
    if attention == "ulysses_flash_attention_2":  # its variable-length path is built, but only CPUs ran it so far
        log.warning("warning: flash_attention_2 under --sequence-parallel has not been verified on a GPU yet; sdpa is (pass it to be sure)")
    warning = quadratic_attention_warning(attention, cfg.max_seq_len, packing)
    if warning:
        log.warning("warning: %s", warning)
    passes = pass_tokens(cfg, device)
    split = f"; micro-batches in passes of up to {passes} tokens" if passes else ""
    log.info("attention: %s; packing %s; loss %s%s%s", attention, "on" if packing else "off", chunks, compiled, split)
    return SpeedLevers(packing, chunk, attention, passes)


def check_inputs(cfg: TrainConfig, reward_functions: list | None = None, tools: list | None = None, environments=None) -> RunInputs:
    """`reward_functions`, `tools`, `environments`: the API's callables and classes (a dict of
    classes: picked by name per row), in place of --reward's, --tools' and --environment's specs."""
    engines.check_compatibility(cfg)
    compilation.check_cell(cfg, engines.spec_of(cfg))
    objectives.check_options(cfg)
    if cfg.eval_steps and not (cfg.eval_data or cfg.eval_split or cfg.eval_prompts or cfg.eval_tasks):
        raise UserError(
            f"--eval-steps {cfg.eval_steps}: there is nothing to evaluate (no --eval-data, --eval-split, --eval-prompts or "
            "--eval-tasks); add one, or leave --eval-steps out"
        )
    objective = objectives.of(cfg)
    toolbox = load_toolbox(tools or cfg.tools, environments or cfg.environment) if objective.online else None
    extra = toolbox.reward_functions() if toolbox else ()
    rewards = load_rewards(reward_functions or cfg.reward, cfg.reward_weights, extra) if objective.online else None
    check_reporter(cfg.report_to)
    base_path = resolve_base(cfg.base)
    base_id = base_path if not Path(base_path).is_dir() else str(Path(base_path).resolve())
    check_not_a_model(Path(cfg.output_dir).expanduser(), base_path)
    output_dir, resume_from = check_output_dir(cfg)
    fingerprint = base_fingerprint(base_path, cfg.allow_bin)
    saved_state = check_resume_settings(cfg, resume_from, fingerprint) if resume_from else None
    tokenizer = load_tokenizer(base_path, cfg.trust_remote_code)
    if toolbox:
        check_template(tokenizer)
    device = pick_device()
    config = load_config(base_path, cfg.trust_remote_code)
    engines.check_layer_by_layer(cfg, quant_method(config))
    engines.check_sequence_parallel(cfg, config, run_world_size(cfg))
    reason = tiled_mlp.refusal(config) if cfg.tiled_mlp == "on" else None
    if reason:
        raise UserError(f"--tiled-mlp on: {reason}; use --tiled-mlp off")
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
    if cfg.train_vision and not is_image_text(config):
        raise UserError("--train-vision: the base is a text-only model (no vision tower); leave it out")
    targets = lora_targets(cfg, config, token_ids(cfg, tokenizer))
    check_init_adapter(cfg, targets)
    serving.check_config(cfg, targets, config.model_type)
    serving.check_rollout(cfg, targets, config.model_type)
    score_tasks = evaluation.task_scorer(cfg)
    levers = speed_levers(cfg, config, device)
    image_text = load_image_text(base_path, config, cfg)
    if isinstance(image_text, ImageText) and not tokenizer.chat_template and image_text.processor.chat_template:
        tokenizer.chat_template = image_text.processor.chat_template  # kept with the processor only (chat_template.json)
    eval_prompts = read_eval_prompts(cfg.eval_prompts, tokenizer, cfg.system_message, image_text) if cfg.eval_prompts else []
    data = prepare_data(cfg, tokenizer, partial(objectives.data_refusal, objective), image_text)
    data_inits.check_data(cfg.init_lora_weights, data.images[0])
    if any(data.images):
        train_images, eval_images = data.images
        log.info(
            "images: %d of %d training and %d of %d evaluation rows hold images (at most %d pixels each)",
            train_images,
            len(data.train),
            eval_images,
            len(data.eval),
            cfg.max_pixels,
        )
        if levers.packing and image_text.packing_refusal:
            attention = attention_implementation(cfg.model_copy(update={"packing": False}), config, device)
            log.info("packing off: %s, so rows with images train in padded batches (attention: %s)", image_text.packing_refusal, attention)
            levers = dataclasses.replace(levers, packing=False, attention=attention)
    for line in data.per_source if len(data.per_source) > 1 else []:
        log.info("data source %s", line)
    log.info("data: %s format, %s; %d train / %d eval samples", data.format, data.stats.summary(), len(data.train), len(data.eval))
    saved_state = check_resume_data(cfg, saved_state, data, resume_from) if resume_from else None
    if toolbox:
        toolbox.check_rows([data.train.row(i) for i in range(len(data.train))])
    if rewards:
        check_reward_columns(rewards, data.train)
        longest = max(data.train.lengths, default=0) + cfg.max_new_tokens
        generation.check_inputs(cfg, base_path, config, longest)
        saved_state = check_rewards_unchanged(cfg, rewards, saved_state)
    row = cfg.max_seq_len * objective.sequences_per_unit  # a unit's sequences travel in one row
    batches = MicroBatches(data.train.lengths, cfg.micro_batch_size, cfg.seed, levers.packing, cfg.group_by_length, row)
    if levers.packing and not objective.online:  # online objectives pack the completions they generate
        tokens = sum(data.train.lengths)
        log.info(
            "packing: %d samples in %d rows of up to %d tokens (%.0f%% full)",
            len(data.train),
            batches.n_rows,
            row,
            100 * tokens / (batches.n_rows * row),
        )
    if objective.online:
        steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch(cfg, len(data.train))))
    else:
        steps = total_steps(cfg, len(batches))
    adapter_types.check_steps(cfg, steps)
    if resume_from:
        check_steps_left(cfg, saved_state, steps, resume_from, output_dir)
    plan = memory_plan(cfg, device, levers.pass_tokens, levers.attention, targets)
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
        objective=objective,
        reference=reference,
        checkpointing=plan.checkpointing if plan else Checkpointing.of(cfg),
        mlp_tiles=plan.mlp_tiles if plan else unplanned_tiles(cfg, config),
        out_of_memory_advice=plan.out_of_memory_advice if plan else (),
        score_tasks=score_tasks,
        rewards=rewards,
        toolbox=toolbox,
        image_text=image_text if any(data.images) else None,
        # A run continued from a chosen checkpoint goes on from its own newest one.
        **({"resume_how": "the same command with --resume alone (no checkpoint named)"} if isinstance(cfg.resume, str) else {}),
    )
