"""The options of the model room: which base, in which precision, and the LoRA put on it."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from lora_tune.options import FREE, MATH, Options, fixed

# Base precisions; which combinations run is each backend's call (lora_tune.engines).
Precision = Literal["fp32", "bf16", "fp16", "8bit", "4bit"]


class ModelOptions(Options):
    """The base model and how its weights are loaded (read by lora_tune.models.loading)."""

    section = "model"

    base: str = Field(json_schema_extra=MATH, description="Base model: an alias (see `lora-tune models`), a hub id or a local directory.")
    precision: Precision = Field(
        "bf16",
        json_schema_extra=MATH,
        description="Base weights: bf16, fp16 (with loss scaling), fp32, 8bit (LLM.int8) or 4bit (NF4, double quant, bf16 "
        "compute). LoRA weights always train in fp32.",
    )
    trust_remote_code: bool = Field(
        False, json_schema_extra=MATH, description="Run model code shipped with a hub repo. Off by default: it executes arbitrary code."
    )
    allow_bin: bool = Field(
        False,
        json_schema_extra=FREE,
        description="Allow loading pickle-based .bin weights when a model has no safetensors (unsafe with untrusted models).",
    )
    attn_implementation: Literal["auto", "sdpa", "sdpa_packed", "flash_attention_2", "eager"] = Field(
        "auto",
        json_schema_extra=FREE,
        description="Attention kernels: auto = flash_attention_2 when installed on a supporting GPU; on a CPU with packing (and "
        "no --compile) sdpa_packed, SDPA once per packed sample instead of a masked row; else sdpa.",
    )


# On --resume: the checkpoint's adapter tensors and their optimizer state have its shape.
ADAPTER_SHAPE = fixed("holds adapter tensors (and their optimizer state) of that shape", from_checkpoint=False)


# On --resume: AdaLoRA's allocator state holds scores and ranks allocated on that schedule.
ADALORA_SCHEDULE = fixed("allocated AdaLoRA's ranks on that schedule")

# peft's init_lora_weights values (lora_tune.models.inits runs them; eva, corda and lora_ga after a
# statistics pass over the run's first micro-batches: lora_tune.models.data_inits).
LORA_INITS = ("gaussian", "orthogonal", "pissa", "pissa_niter_N", "olora", "eva", "corda", "loftq", "lora_ga")
INIT_REFUSED = {
    "loftq": "peft's LoftQ quantizes each weight on a CUDA (or XPU) device it names itself (peft.utils.loftq_utils), so it "
    "can't run where lora-tune is tested, and lora-tune ships nothing it hasn't run. Use pissa on a bf16 base (or eva on a "
    "4-bit one), or leave it out",
}


class LoraOptions(Options):
    """The adapter's shape (read by lora_tune.models.targets and .adapter)."""

    section = "LoRA"

    peft_type: Literal["lora", "oft", "boft", "loha", "lokr", "vera", "ia3", "adalora", "miss", "hra"] = Field(
        "lora",
        json_schema_extra=ADAPTER_SHAPE,
        description="peft's adapter type: lora (default), oft, boft, loha, lokr, vera, ia3, adalora, miss, hra. --rank/--alpha/"
        "--dropout go to the type's own knobs (OFT/BOFT: block size; IA3: none; AdaLoRA: the starting rank), an unused one said "
        "once; LoRA-only options are refused with another type. Every type on one process and DDP; ZeRO-1/2 and ZeRO-3 but "
        "adalora (and loha on ZeRO-3); FSDP2 for loha, lokr, ia3, miss, hra; merged through peft; vLLM and llama.cpp serve LoRA "
        "only (merge first); the matrix's adapter table has each cell.",
    )
    rank: int = Field(
        16,
        gt=0,
        json_schema_extra={**ADAPTER_SHAPE, "hint": "typical values are 8, 16, 32, 64"},
        description="LoRA rank r.",
    )
    alpha: float | None = Field(
        None, json_schema_extra=MATH, description="LoRA alpha (scale = alpha / r, or alpha / sqrt(r) with --rslora). Default: 2 x rank."
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        json_schema_extra=MATH,
        description="Dropout on the LoRA input (0 skips the dropout layer: ~20% faster steps on small models; Unsloth and "
        "LLaMA-Factory default to 0 as well).",
    )
    target_modules: list[str] | None = Field(
        None,
        json_schema_extra=ADAPTER_SHAPE,
        description="Module names to adapt, e.g. q_proj v_proj. Default: every linear layer of the transformer blocks (never lm_head).",
    )
    train_vision: bool = Field(
        False,
        json_schema_extra=ADAPTER_SHAPE,
        description="Image-text models: also put LoRA on the vision tower's and projector's linear layers (every one by default; "
        "with --target-modules, those of the names given, in both parts). Off: they stay frozen, get no LoRA and no gradients, "
        "and target names that also match them are left out and reported.",
    )
    init_lora_weights: str | None = Field(
        None,
        json_schema_extra=fixed("started from that init (PiSSA, OLoRA, CorDA, LoRA-GA: training the residual base it left)"),
        description="LoRA's initial values, peft's names: gaussian (A ~ N(0, 1/r)), orthogonal (A, B with BA = 0; even rank), "
        "pissa (A, B from the weight's top r singular vectors, the base keeps the residual), pissa_niter_N (the same by N "
        "subspace iterations: fast), olora (from a QR of the weight; residual base). Every one keeps the base's function at "
        "step 0. PiSSA/OLoRA adapters are written converted to a plain LoRA of the original base (rank 2r, peft's "
        "path_initial_model_for_weight_conversion). From the run's first --init-batches micro-batches: eva (A from an SVD of "
        "each layer's inputs, B = 0; every layer keeps --rank), corda (the weight decomposed with its inputs' covariance; "
        "residual base, converted), lora-ga (A, B from an SVD of each weight's gradient of the run's loss; residual base, "
        "converted). loftq is refused, saying why. Default: peft's (Kaiming A, zero B). LoRA only.",
    )
    init_batches: int | None = Field(
        None,
        gt=0,
        json_schema_extra=fixed("started from an init computed over that many micro-batches"),
        description="--init-lora-weights eva, corda, lora-ga: how many of the run's first micro-batches the statistics pass "
        "reads (default 8; peft's examples use a few hundred sequences: more is steadier and slower).",
    )
    rank_pattern: list[str] | None = Field(
        None,
        json_schema_extra=ADAPTER_SHAPE,
        description="Other ranks for some modules: REGEX=R ..., the regex matched against module names as peft's rank_pattern "
        "does (the full name or a dotted suffix, e.g. down_proj=32 or 'layers\\.0\\..*=8'); the first that matches wins.",
    )
    alpha_pattern: list[str] | None = Field(
        None,
        json_schema_extra=MATH,
        description="Other alphas for some modules: REGEX=A ..., matched as --rank-pattern (peft's alpha_pattern).",
    )
    layers_to_transform: list[int] | None = Field(
        None,
        json_schema_extra=ADAPTER_SHAPE,
        description="Adapt only these decoder layers (indices from 0; peft's layers_to_transform); default: every layer.",
    )
    trainable_tokens: list[str] | None = Field(
        None,
        json_schema_extra=ADAPTER_SHAPE,
        description="Train the embedding rows of these tokens (new or special tokens, as the tokenizer spells them, e.g. "
        "'<|im_start|>'), not the whole embedding (peft's trainable_token_indices; tied output rows follow).",
    )
    modules_to_save: list[str] | None = Field(
        None,
        json_schema_extra=ADAPTER_SHAPE,
        description="Modules trained in full beside the adapter and saved with it (peft's modules_to_save), e.g. lm_head or "
        "embed_tokens. vLLM and llama.cpp can't take them: merge first.",
    )
    adalora_target_r: int | None = Field(
        None,
        gt=0,
        json_schema_extra=ADALORA_SCHEDULE,
        description="--peft-type adalora: the average rank the budget falls to (peft's target_r). Default: two thirds of --rank "
        "(peft's 8 of 12).",
    )
    adalora_tinit: int | None = Field(
        None, ge=0, json_schema_extra=ADALORA_SCHEDULE, description="--peft-type adalora: first steps at full rank (tinit, default 0)."
    )
    adalora_tfinal: int | None = Field(
        None,
        ge=0,
        json_schema_extra=ADALORA_SCHEDULE,
        description="--peft-type adalora: final steps with the ranks fixed (peft's tfinal; default 0).",
    )
    adalora_delta_t: int | None = Field(
        None, gt=0, json_schema_extra=ADALORA_SCHEDULE, description="--peft-type adalora: steps between reallocations (deltaT, default 1)."
    )
    adalora_orth_reg_weight: float | None = Field(
        None,
        ge=0,
        json_schema_extra=MATH,
        description="--peft-type adalora: weight of the orthogonality penalty on P and Q, added once per optimizer step (peft's "
        "orth_reg_weight; default 0.5).",
    )
    rslora: bool = Field(False, json_schema_extra=MATH, description="Rank-stabilised LoRA scaling alpha / sqrt(r).")
    dora: bool = Field(False, json_schema_extra=ADAPTER_SHAPE, description="Weight-decomposed LoRA (DoRA).")
    init_adapter: str | None = Field(
        None,
        json_schema_extra=fixed("continues its own adapter, which started from this one (dpo/ipo/kto's reference too)"),
        description="Start from this adapter folder (e.g. an SFT run's output) instead of a fresh adapter; it is also the reference of "
        "dpo/ipo/kto. Its rank and targets become the run's.",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v):
        if v is not None and (not v or "lm_head" in v):
            raise ValueError("give module names such as q_proj v_proj (lm_head is never adapted); leave it out for all linear layers")
        return v

    @field_validator("init_lora_weights")
    @classmethod
    def _init(cls, v):
        if v is None:
            return v
        name = v.strip().lower().replace("-", "_")  # lora-ga as people write it, lora_ga as peft does
        if name in INIT_REFUSED:
            raise ValueError(f"{v} is refused: {INIT_REFUSED[name]}")
        if name not in LORA_INITS and not re.fullmatch(r"pissa_niter_\d+", name):
            raise ValueError(f"unknown init {v!r}; choose from {', '.join(LORA_INITS).replace('lora_ga', 'lora-ga')}")
        return name

    @field_validator("rank_pattern", "alpha_pattern")
    @classmethod
    def _patterns(cls, v, info):
        what = "R" if info.field_name == "rank_pattern" else "A"
        for item in v or ():
            regex, _, value = item.rpartition("=")
            if not regex:
                raise ValueError(f"{item!r} has no ={what}; write REGEX={what}, e.g. down_proj={32 if what == 'R' else 64}")
            try:
                re.compile(regex)
                number = int(value) if what == "R" else float(value)
            except re.error as e:
                raise ValueError(f"{regex!r} is not a regular expression ({e})") from None
            except ValueError:
                number = 0
            if number <= 0:
                kind = "a positive integer rank" if what == "R" else "a positive alpha"
                raise ValueError(f"{item!r}: {value!r} is not {kind}; write REGEX={what}")
        return v

    @field_validator("layers_to_transform")
    @classmethod
    def _layers(cls, v):
        if v is not None and (not v or min(v) < 0):
            raise ValueError("give decoder layer indices from 0, e.g. 0 1 2; leave it out for every layer")
        return v

    @property
    def rank_patterns(self) -> dict[str, int]:
        """--rank-pattern as peft's rank_pattern: regex -> rank."""
        return {k: int(v) for k, _, v in (item.rpartition("=") for item in self.rank_pattern or ())}

    @property
    def alpha_patterns(self) -> dict[str, float | int]:
        """--alpha-pattern as peft's alpha_pattern (an integral alpha as an integer, as lora_alpha)."""
        values = {k: float(v) for k, _, v in (item.rpartition("=") for item in self.alpha_pattern or ())}
        return {k: int(v) if v.is_integer() else v for k, v in values.items()}

    @property
    def lora_alpha(self) -> float | int:
        """What peft records in adapter_config.json: an integral alpha as an integer, since readers
        such as Ollama's converter parse `lora_alpha` as one and refuse 16.0."""
        alpha = self.alpha if self.alpha is not None else 2 * self.rank
        return int(alpha) if float(alpha).is_integer() else alpha
