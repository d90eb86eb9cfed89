"""The options of the objectives: which one trains, and each one's own strengths."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lora_tune.options import FREE, MATH, Options


class ObjectiveOptions(Options):
    """What the adapter learns (read by lora_tune.training.objectives)."""

    section = "objective"

    objective: Literal["sft", "dpo", "ipo", "orpo", "simpo", "kto"] = Field(
        "sft",
        json_schema_extra=MATH,
        description="What the adapter learns: sft (next tokens of the data), or from preferences: dpo, ipo (pairs, against the reference "
        "model: the model at the start), orpo, simpo (pairs, reference-free), kto (rows marked desirable or not, against the reference).",
    )
    beta: float = Field(
        0.1, gt=0, json_schema_extra=MATH, description="dpo, ipo, simpo, kto: the strength of the preference (DPO's beta; IPO's tau)."
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
