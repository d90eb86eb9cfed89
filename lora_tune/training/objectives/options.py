"""The options of the objectives: which one trains, and each one's own strengths; online RL's
(GRPO: rollouts, rewards, the clipped loss) in a section of their own."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from lora_tune.options import FREE, MATH, Options, fixed

# beta's default per objective: DPO's 0.1 (TRL's DPO/KTO/CPO default); GRPO's 0.0 (TRL's GRPO
# default since 0.19: no KL term, so no reference forward).
BETA_DEFAULT = {"grpo": 0.0}


class ObjectiveOptions(Options):
    """What the adapter learns (read by lora_tune.training.objectives)."""

    section = "objective"

    objective: Literal["sft", "dpo", "ipo", "orpo", "simpo", "kto", "grpo"] = Field(
        "sft",
        json_schema_extra=fixed("counts its place in the data in that objective's units (rows, pairs, or prompts of generation batches)"),
        description="What the adapter learns: sft (next tokens of the data), or from preferences: dpo, ipo (pairs, against the reference "
        "model: the model at the start), orpo, simpo (pairs, reference-free), kto (rows marked desirable or not, against the reference); "
        "or by online RL from rewards: grpo (prompts; completions generated and scored by --reward functions).",
    )
    beta: float | None = Field(
        None,
        ge=0,
        validate_default=True,
        json_schema_extra=MATH,
        description="dpo, ipo, simpo, kto: the strength of the preference (DPO's beta; IPO's tau; default 0.1). grpo: the weight of the "
        "KL term against the reference, the model with its adapter disabled (default 0.0: none, as TRL).",
    )
    orpo_lambda: float = Field(
        0.1, gt=0, json_schema_extra=MATH, description="orpo: the weight of the odds-ratio term beside the chosen NLL."
    )
    simpo_gamma: float = Field(0.5, ge=0, json_schema_extra=MATH, description="simpo: the target reward margin gamma.")
    kto_desirable_weight: float = Field(1.0, gt=0, json_schema_extra=MATH, description="kto: the weight of desirable rows' loss.")
    kto_undesirable_weight: float = Field(1.0, gt=0, json_schema_extra=MATH, description="kto: the weight of undesirable rows' loss.")
    reference: Literal["auto", "precompute", "per-step"] = Field(
        "auto",
        json_schema_extra=FREE,
        description="dpo, ipo, kto: the reference log-probabilities computed once before training (kept in the data cache) or at every "
        "step with the adapter disabled; auto picks the faster for this run (the same numbers either way).",
    )

    @field_validator("beta")
    @classmethod
    def _beta(cls, v, info: ValidationInfo):
        objective = info.data.get("objective", "sft")
        if v is None:
            return BETA_DEFAULT.get(objective, 0.1)
        if v == 0 and objective != "grpo":
            raise ValueError(f"must be > 0 for --objective {objective} (got 0)")
        return v


class GRPOOptions(Options):
    """Online RL with verifiable rewards (read by lora_tune.training.rollout and the grpo objective);
    names and defaults as TRL's GRPOConfig, so settings transfer."""

    section = "online RL (--objective grpo)"

    reward: list[str] | None = Field(
        None,
        json_schema_extra=MATH,
        description="grpo: reward functions with TRL's signature f(prompts, completions, completion_ids, **columns) -> list[float | None], "
        "as file.py:func or module:func (several: summed with --reward-weights).",
    )
    reward_weights: list[float] | None = Field(None, json_schema_extra=MATH, description="grpo: one weight per --reward (default 1 each).")
    num_generations: int = Field(
        8,
        ge=2,
        json_schema_extra=fixed("counts its place in the prompts in generation batches of that group size, and may keep one in flight"),
        description="grpo: completions generated per prompt (the group size G).",
    )
    max_new_tokens: int = Field(256, gt=0, json_schema_extra=MATH, description="grpo: the longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, json_schema_extra=MATH, description="grpo: sampling temperature (log-probs use it too, as TRL).")
    top_p: float = Field(1.0, gt=0, le=1, json_schema_extra=MATH, description="grpo: nucleus sampling (1: off).")
    top_k: int = Field(0, ge=0, json_schema_extra=MATH, description="grpo: sample from the k likeliest tokens only (0: off).")
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = Field(
        "dapo",
        json_schema_extra=MATH,
        description="grpo: how token losses are averaged: dapo (over the step's completion tokens, TRL's default), grpo (per completion, "
        "then over completions), dr_grpo (over completions x --max-new-tokens), bnpo (over each micro-batch's tokens).",
    )
    importance_sampling: Literal["token", "sequence"] = Field(
        "token", json_schema_extra=MATH, description="grpo: importance ratios per token, or per sequence (GSPO)."
    )
    epsilon: float = Field(
        0.2, gt=0, json_schema_extra=MATH, description="grpo: the clipping range below 1 (and above, unless --epsilon-high)."
    )
    epsilon_high: float | None = Field(
        None, gt=0, json_schema_extra=MATH, description="grpo: the clipping range above 1 (DAPO's clip-higher)."
    )
    num_iterations: int = Field(
        1,
        gt=0,
        json_schema_extra=fixed("counts its place in the prompts in generation batches of that many steps, and may keep one in flight"),
        description="grpo: optimizer steps per generation batch (old log-probs computed once, reused).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", json_schema_extra=MATH, description="grpo: advantages divided by the group's reward std, the batch's, or not at all."
    )
    rollout: Literal["transformers", "vllm"] = Field(
        "transformers",
        json_schema_extra=FREE,
        description="grpo: what generates the completions: transformers' generate on the training engine (KV cache, every "
        "engine), or vllm: a vLLM server or colocated engine that gets the adapter each generation batch (see --vllm-mode).",
    )
    mask_truncated: bool = Field(
        False, json_schema_extra=MATH, description="grpo: completions cut at --max-new-tokens (no EOS) take no part in the loss."
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _one_reward(cls, v):
        return [v] if isinstance(v, str) else v


class AgentOptions(Options):
    """Agentic RL: tools the policy calls and environments it acts in during its rollouts (read by
    lora_tune.training.tools and lora_tune.training.episodes); TRL 1.16's `tools=` and
    `environment_factory`."""

    section = "tools and environments (--objective grpo)"

    tools: list[str] | None = Field(
        None,
        json_schema_extra=MATH,
        description="grpo: functions the policy may call, as file.py:func or module:func, each with type hints and a docstring "
        "(described to the model through its chat template's tools); a data column `tools` (names) narrows them per row.",
    )
    environment: list[str] | None = Field(
        None,
        json_schema_extra=MATH,
        description="grpo: environment classes (file.py:Class): one fresh instance per completion, reset(**row) -> text appended "
        "to the prompt, its public methods as tools, get_reward() an extra reward named after the class; several: a data column "
        "`environment` picks one by class name per row.",
    )
    max_tool_calls: int | None = Field(
        None,
        gt=0,
        json_schema_extra=MATH,
        description="grpo: tool-calling turns per completion (TRL's max_tool_calling_iterations; default: until --max-new-tokens, "
        "which bounds the whole completion, tool results included, as TRL's max_completion_length).",
    )
    tool_timeout: float = Field(
        30.0,
        gt=0,
        json_schema_extra=MATH,
        description="grpo: seconds a tool call may run before it is abandoned and the model gets an error (a tool runs in the "
        "trainer's process, in a thread that can't be killed).",
    )
    max_tool_result_tokens: int = Field(
        256, gt=0, json_schema_extra=MATH, description="grpo: a tool result longer than this many tokens is cut to it (and counted)."
    )

    @field_validator("tools", "environment", mode="before")
    @classmethod
    def _one_spec(cls, v):
        return [v] if isinstance(v, str) else v
