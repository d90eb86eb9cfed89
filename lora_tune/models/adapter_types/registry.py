"""The adapter types, by --peft-type name, and what a run with one must not ask for."""

from __future__ import annotations

import logging

from lora_tune.errors import UserError
from lora_tune.models.adapter_types import adalora, boft, hra, ia3, loha, lokr, lora, miss, oft, vera

log = logging.getLogger("lora_tune")

TYPES = {m.TYPE.name: m.TYPE for m in (lora, oft, boft, loha, lokr, vera, ia3, adalora, miss, hra)}

# LoRA's own options: flag -> is it set in this config.
LORA_ONLY = {
    "--dora": lambda cfg: cfg.dora,
    "--rslora": lambda cfg: cfg.rslora,
    "--init-lora-weights": lambda cfg: cfg.init_lora_weights is not None,
    "--loraplus-lr-ratio": lambda cfg: cfg.loraplus_lr_ratio is not None,
    "--rank-pattern": lambda cfg: bool(cfg.rank_pattern),
    "--alpha-pattern": lambda cfg: bool(cfg.alpha_pattern),
    "--trainable-tokens": lambda cfg: bool(cfg.trainable_tokens),
    "--init-adapter": lambda cfg: cfg.init_adapter is not None,
}


def is_lora(cfg) -> bool:
    return getattr(cfg, "peft_type", "lora") == "lora"


def check(cfg, whole_gradients: bool) -> None:
    """Before loading: LoRA-only options with another type, another type's own options, a quantized
    base peft has no layers for, ZeRO-3 (it partitions the base first) where the type can't be built
    there, a type with step hooks on a backend whose ranks don't hold every gradient whole
    (`whole_gradients`), each one line; the options the type has no knob for are said once."""
    for other in TYPES.values():
        given = [name for name in other.options if getattr(cfg, name, None) is not None]
        if given and other.name != cfg.peft_type:
            flag = "--" + given[0].replace("_", "-")
            raise UserError(f"{flag} is an option of --peft-type {other.name}, not of {cfg.peft_type}: leave it out (or change the type)")
    if is_lora(cfg):
        return
    kind = TYPES[cfg.peft_type]
    flag = f"--peft-type {cfg.peft_type}"
    for option, given in LORA_ONLY.items():
        if given(cfg):
            raise UserError(f"{option} is a LoRA option; {flag} has no such thing: leave it out (or use --peft-type lora)")
    if cfg.precision in ("8bit", "4bit") and not kind.quantized:
        raise UserError(
            f"{flag}: peft has no bitsandbytes layers for {cfg.peft_type}, so it can't adapt a {cfg.precision} base: use --precision bf16"
        )
    if kind.step_hooks and not whole_gradients:
        raise UserError(
            f"{flag}: its step (the rank allocator, peft's update_and_allocate) reads every adapter gradient whole on every rank "
            "after the optimizer step, which DeepSpeed and FSDP2 keep partitioned (or free): train it on one device, or on several "
            "with DDP (--nproc N, no --zero / --backend fsdp)"
        )
    if cfg.zero == 3 and not kind.partitioned_base:
        raise UserError(
            f"{flag}: peft sizes a {cfg.peft_type} adapter from each base weight's shape, and ZeRO-3 has partitioned the base "
            "before the adapter goes in (every rank sees empty weights): "
            + "use --backend fsdp (it fills each layer's adapter as the base streams in) or --zero 2"
        )
    ignored = [f"--{option}" for option, knob in kind.knobs.items() if knob is None]
    if ignored:
        log.info("%s has no knob for %s: ignored", flag, ", ".join(ignored))
    mapped = ", ".join(f"--{option} -> {knob}" for option, knob in kind.knobs.items() if knob)
    if mapped:
        log.info("%s: %s", flag, mapped)


def reset_of(cfg):
    """The per-layer init of the run's type (None for LoRA, whose inits lora_tune.models.inits runs)."""
    return None if is_lora(cfg) else TYPES[cfg.peft_type].reset


def draw_fixed(cfg, peft_model) -> None:
    """The run's type's fixed tensors made real on a meta skeleton (AdapterType.fixed)."""
    kind = TYPES[getattr(cfg, "peft_type", "lora")]
    if kind.fixed:
        kind.fixed(peft_model)


def check_steps(cfg, total_steps: int) -> None:
    """Before loading, the run's length known: the type's own refusal of it (AdaLoRA's schedule)."""
    kind = TYPES[getattr(cfg, "peft_type", "lora")]
    if kind.check_steps:
        kind.check_steps(cfg, total_steps)


def planned(cfg):
    """The run's type's per-linear planner terms where peft can't build it on a meta skeleton
    (AdapterType.planned), or None."""
    return TYPES[getattr(cfg, "peft_type", "lora")].planned


def state_bytes(cfg) -> int:
    """Bytes per trained element the run's type keeps beside the optimizer (its step hooks' state)."""
    return TYPES[getattr(cfg, "peft_type", "lora")].state_bytes


def step_hooks(cfg, peft_model, total_steps: int):
    """What the run's type does around each optimizer step (base.StepHooks), or None."""
    kind = TYPES[getattr(cfg, "peft_type", "lora")]
    return kind.step_hooks(peft_model, total_steps) if kind.step_hooks else None


def peft_config(cfg, modules, model_type: str):
    """The type's peft config for these target modules (peft's target_modules: names or a pattern)."""
    return TYPES[cfg.peft_type].build(cfg, modules, model_type)
