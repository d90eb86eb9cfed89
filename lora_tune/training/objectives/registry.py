"""What a run trains: next tokens (SFT), preferences, or rewards (GRPO, online). Each objective says
what data it takes, how its batches are built (samples, units of sequences scored whole, or
completions generated from the data's prompts), whether it needs the reference policy, and which
loss module the engines train; the recipe and the loop read these, never the objective's name."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lora_tune.errors import UserError
from lora_tune.training.generation.options import VLLMOptions
from lora_tune.training.objectives.grpo import GRPOLoss
from lora_tune.training.objectives.options import AgentOptions, GRPOOptions
from lora_tune.training.objectives.preference import WITH_REFERENCE, PreferenceLoss
from lora_tune.training.objectives.sft import CausalLMLoss


@dataclass(frozen=True)
class Objective:
    name: str
    data: str  # the kind of data it trains on (lora_tune.data.formats.kind): sft | pairs | unpaired
    units: bool  # batches of units whose sequences are scored whole (lora_tune.data.batching.collate)
    sequences_per_unit: int  # a packed row holds this many sequences of up to --max-seq-len per unit
    reference: bool  # compares against the model at the start of training (precomputed or per step)
    online: bool = False  # trains on completions the policy generates for the data's prompts (lora_tune.training.rollout)

    def loss_module(self, peft_model, chunk_size: int | None, cfg):
        if self.name == "sft":
            return CausalLMLoss(peft_model, chunk_size)
        if self.online:
            return GRPOLoss(peft_model, chunk_size, cfg)
        return PreferenceLoss(peft_model, chunk_size, self.name, cfg)


OBJECTIVES = {
    "sft": Objective("sft", "sft", units=False, sequences_per_unit=1, reference=False),
    **{name: Objective(name, "pairs", True, 2, name in WITH_REFERENCE) for name in ("dpo", "ipo", "orpo", "simpo")},
    "kto": Objective("kto", "unpaired", units=True, sequences_per_unit=2, reference=True),
    # The reference of GRPO's KL term is scored per rollout, inside it (lora_tune.training.rollout).
    "grpo": Objective("grpo", "prompts", units=False, sequences_per_unit=1, reference=False, online=True),
}
DATA_FOR = {
    "sft": "text, alpaca, chat (messages / conversations), prompt + completion or pretokenized rows",
    "pairs": "preference pairs: prompt + chosen + rejected",
    "unpaired": "rows marked desirable or not: prompt + completion + label",
    "prompts": "prompts to complete: prompt (text or messages), other columns passed to the reward functions",
}


def of(cfg) -> Objective:
    return OBJECTIVES[cfg.objective]


# The options each objective reads; given to another one they would change nothing, so they are refused.
OPTIONS = {
    "beta": ("dpo", "ipo", "simpo", "kto", "grpo"),
    "orpo_lambda": ("orpo",),
    "simpo_gamma": ("simpo",),
    "kto_desirable_weight": ("kto",),
    "kto_undesirable_weight": ("kto",),
    "reference": tuple(name for name, o in OBJECTIVES.items() if o.reference),
    **{name: ("grpo",) for name in GRPOOptions.model_fields},
    **{name: ("grpo",) for name in AgentOptions.model_fields},
    **{name: ("grpo",) for name in VLLMOptions.model_fields},
}


def check_options(cfg) -> None:
    """Options of another objective (set to other than their default) and --train-on-prompt with
    preferences (the prompt is shared by both answers and scored by none) are refused."""
    fields = type(cfg).model_fields
    for name, users in OPTIONS.items():
        if name in cfg.model_fields_set and cfg.objective not in users and getattr(cfg, name) != fields[name].default:
            flag = "--" + name.replace("_", "-")
            hint = "; ORPO's weight is --orpo-lambda" if name == "beta" and cfg.objective == "orpo" else ""
            raise UserError(f"{flag} applies to --objective {' / '.join(users)}, not {cfg.objective}: leave it out{hint}")
    if cfg.train_on_prompt and cfg.objective != "sft":
        raise UserError(
            f"--train-on-prompt trains next tokens (--objective sft); --objective {cfg.objective} scores only the answers: leave it out"
        )
    if of(cfg).online:
        check_online(cfg)


def check_online(cfg) -> None:
    """GRPO's own rules, before anything loads: rewards to score with, whole groups per step."""
    if not cfg.reward and not cfg.environment:
        raise UserError("--objective grpo needs at least one --reward: a function f(prompts, completions, **kwargs) as file.py:func")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward):
        raise UserError(
            f"--reward-weights: {len(cfg.reward_weights)} weights for {len(cfg.reward)} --reward functions; give one weight per function"
        )
    if cfg.eval_data or cfg.eval_split:
        raise UserError(
            "--objective grpo trains on prompts, which have no loss to evaluate: leave out --eval-data / --eval-split and watch the "
            "rewards, or sample with --eval-prompts"
        )
    fields = type(cfg).model_fields
    for name in VLLMOptions.model_fields:
        if cfg.rollout != "vllm" and name in cfg.model_fields_set and getattr(cfg, name) != fields[name].default:
            raise UserError(f"--{name.replace('_', '-')} applies to --rollout vllm: add it, or leave the option out")
    # Each rank generates and trains whole groups (lora_tune.training.rollout): a rank's step holds
    # --micro-batch-size x --grad-accum completions, G per prompt.
    completions = cfg.micro_batch_size * cfg.grad_accum
    if completions % cfg.num_generations:
        raise UserError(
            f"--objective grpo: a step trains --micro-batch-size x --grad-accum = {completions} completions per process, not a "
            f"multiple of --num-generations {cfg.num_generations}, so a group would be split; make it a multiple (e.g. "
            f"--grad-accum {cfg.num_generations // math.gcd(cfg.num_generations, cfg.micro_batch_size)})"
        )


def data_refusal(objective: Objective, kind: str, fmt: str, source: str) -> str | None:
    """Why this source's format can't train this objective, or None."""
    if kind == objective.data:
        return None
    fitting = [name for name, o in OBJECTIVES.items() if o.data == kind]
    return (
        f"--objective {objective.name} trains on {DATA_FOR[objective.data]}; {source} holds {fmt} data ({DATA_FOR[kind]}): "
        f"use --objective {' or '.join(fitting)} for it"
    )


def reference_mode(cfg, objective: Objective, units_trained: int, units_in_data: int, cached: bool) -> str | None:
    """How the reference log-probabilities are computed: None (no reference), "precompute" (one
    pass over the data before training, kept in the data cache and the run) or "per-step" (a no-grad
    forward with the adapter disabled at every step). Both cost one forward per unit scored: the
    precomputed pass scores the whole data set once (nothing when cached), per step scores every unit
    trained on (epochs x data). With --init-adapter only the precomputed pass can reproduce the
    starting model (disabling the adapter gives the base)."""
    if not objective.reference:
        return None
    if cfg.reference != "auto":
        return cfg.reference
    if cfg.init_adapter or cached or units_trained >= units_in_data:
        return "precompute"
    return "per-step"
