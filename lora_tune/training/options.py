"""The options of the training room: the optimisation, speed and memory levers, evaluation during
training, and the output folder."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from lora_tune.options import FREE, MATH, Options, fixed


class OptimOptions(Options):
    """The optimizer, schedule, batch and run length (read by lora_tune.engines.common and the loop)."""

    section = "optimisation"

    optim: Literal["adamw_8bit", "paged_adamw_8bit", "adamw"] = Field(
        "adamw_8bit",
        json_schema_extra=fixed(
            "holds that optimizer's state (torch AdamW's moments or bitsandbytes' 8-bit states), which another can't load"
        ),
        description="Optimizer: bitsandbytes 8-bit AdamW (default), its paged variant, or torch AdamW.",
    )
    lr: float = Field(
        2e-4, gt=0, json_schema_extra={**MATH, "hint": "LoRA usually trains with 1e-4 to 3e-4"}, description="Peak learning rate."
    )
    weight_decay: float = Field(0.0, ge=0, json_schema_extra=MATH, description="AdamW weight decay.")
    loraplus_lr_ratio: float | None = Field(
        None,
        gt=0,
        json_schema_extra={
            **fixed("holds the optimizer state in the param groups LoRA+ splits it into (A's, and B's at its own rate)"),
            "hint": "the LoRA+ paper uses 16; leave it out for plain LoRA",
        },
        description="LoRA+: the B matrices (and 1-d LoRA tensors such as DoRA's magnitudes) train at R x --lr, the A matrices "
        "at --lr (peft's create_loraplus_optimizer grouping), on every optimizer and backend. LoRA only.",
    )
    warmup_steps: int = Field(0, ge=0, json_schema_extra=MATH, description="Linear warmup steps (overrides --warmup-ratio when > 0).")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, json_schema_extra=MATH, description="Warmup as a fraction of the total steps.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", json_schema_extra=MATH, description="Learning-rate schedule after warmup."
    )
    max_grad_norm: float = Field(1.0, ge=0, json_schema_extra=MATH, description="Clip the gradient norm to this (0 disables clipping).")
    micro_batch_size: int = Field(
        1,
        gt=0,
        json_schema_extra=fixed("counts its place in the data in micro-batches of that size"),
        description="Samples per forward/backward.",
    )
    grad_accum: int = Field(
        1,
        gt=0,
        json_schema_extra=fixed("counts its place in the data in steps of that many micro-batches"),
        description="Micro-batches per optimizer step.",
    )
    epochs: float = Field(1.0, gt=0, json_schema_extra=FREE, description="Passes over the data (ignored when --max-steps is given).")
    max_steps: int | None = Field(None, gt=0, json_schema_extra=FREE, description="Stop after this many optimizer steps.")
    seed: int = Field(
        42,
        json_schema_extra=fixed("is inside an epoch whose order that seed drew"),
        description="Seed for data order, LoRA init and dropout.",
    )
    max_bad_steps: int = Field(
        3,
        gt=0,
        json_schema_extra=FREE,
        description="Stop after this many consecutive steps with NaN/inf loss or gradient norm (those steps are skipped, and logged).",
    )


class SpeedOptions(Options):
    """Levers that change speed and memory, not the math (read by the preflight, the planner and compilation)."""

    section = "speed and memory"

    gradient_checkpointing: Literal["on", "off", "auto"] = Field(
        "auto",
        json_schema_extra=FREE,
        description="Recompute decoder layers' activations in backward (non-reentrant) to save memory: on (every layer), off, or "
        "auto: the fewest layers such that the memory plan fits --memory-budget, the others keep their activations (on a CPU, "
        "where there is no device budget: every layer but the last, which costs no more memory than recomputing it).",
    )
    memory_budget: float | None = Field(
        None,
        gt=0,
        json_schema_extra=FREE,
        description="GiB of GPU memory --gradient-checkpointing auto plans for. Default: the GPU's memory less 10%.",
    )
    tiled_mlp: Literal["on", "off", "auto"] = Field(
        "auto",
        json_schema_extra=FREE,
        description="Compute each decoder layer's MLP over tiles of the sequence (tiles of max(hidden size, 1,024) tokens), each "
        "recomputed in backward, so a long row never holds its full [tokens x intermediate] activations; one more MLP forward "
        "per step. auto: on when the memory plan with every layer checkpointed exceeds the budget (--memory-budget, the GPU's "
        "memory less 10%, a CPU's RAM) and tiling lowers it. Dense MLPs (not mixtures of experts).",
    )
    activation_offload: bool = Field(
        False,
        json_schema_extra=FREE,
        description="With checkpointing, keep the checkpointed layer inputs in pinned host memory instead of on the GPU (CUDA "
        "only; slower steps, less GPU memory at long sequences).",
    )
    compile: bool = Field(
        False,
        json_schema_extra=FREE,
        description="Compile each decoder layer and the loss's chunk step with torch.compile (regional: one graph serves every "
        "layer; dynamic shapes, so packed batches of any width reuse it) for fused kernels. The first step pays the compile time "
        "(logged), later runs of the same setup hit PyTorch's on-disk cache. Not with 8/4-bit bases or ZeRO-3. Off by default: "
        "see docs/performance.md for where it pays.",
    )
    loss_chunk_size: int | None = Field(
        None,
        ge=0,
        json_schema_extra={**FREE, "hint": "0 computes the full logits; leave it out for the automatic size"},
        description="Compute the output head and cross-entropy this many label tokens at a time, never materialising the "
        "whole [tokens x vocab] logits. Default: about tokens x hidden / vocab per chunk (logits no bigger than the hidden "
        "states), at least 128; 0: the model's own full-logits loss.",
    )
    strict_memory: bool = Field(
        False, json_schema_extra=FREE, description="Refuse to start when the memory plan says the run will not fit (default: warn)."
    )

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, v):
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v  # YAML true/false as before


class EvalOptions(Options):
    """When and what the loop evaluates (lm-eval tasks: the after-training section)."""

    section = "evaluation during training"

    eval_steps: int | None = Field(
        None,
        gt=0,
        json_schema_extra=FREE,
        description="Evaluate every N optimizer steps (default: only at the end, when there is eval data).",
    )
    eval_prompts: str | None = Field(
        None,
        json_schema_extra=FREE,
        description="A .txt (one prompt per line) or .jsonl (prompt | instruction | messages) file of up to 8 prompts; their "
        "greedy completions are logged at each evaluation.",
    )
    eval_max_new_tokens: int = Field(64, gt=0, json_schema_extra=FREE, description="Tokens generated per --eval-prompts prompt.")


class OutputOptions(Options):
    """The output folder, checkpoints, resume and reporting (read by lora_tune.training)."""

    section = "output"

    output_dir: str = Field(json_schema_extra=FREE, description="Where the adapter, checkpoints and metrics go.")
    save_steps: int | None = Field(
        None, gt=0, json_schema_extra=FREE, description="Write a checkpoint every N optimizer steps (default: only at the end)."
    )
    save_total_limit: int | None = Field(
        None, gt=0, json_schema_extra=FREE, description="Keep at most N checkpoints (the newest complete one is never removed)."
    )
    resume: bool | str = Field(
        False,
        json_schema_extra={**FREE, "flag_value": "CHECKPOINT"},
        description="Continue from the newest complete checkpoint in --output-dir; --resume RUN/checkpoint-STEP continues from that "
        "one: in its own run when it is the newest there, else into a new --output-dir (the run it comes from stays as it is). "
        "docs/reference/resume.md says which settings may change.",
    )
    allow_config_change: bool = Field(
        False,
        json_schema_extra=FREE,
        description="On --resume, continue with settings or data that differ from the checkpoint's: applied from the first resumed "
        "step (learning rate, schedule, data, ...); what the checkpoint's state is made of (rank, optimizer, backend, ...) is "
        "refused all the same.",
    )
    logging_steps: int = Field(1, gt=0, json_schema_extra=FREE, description="Write metrics every N optimizer steps.")
    report_to: Literal["none", "tensorboard", "wandb"] = Field(
        "none", json_schema_extra=FREE, description="Also send metrics to TensorBoard or Weights & Biases."
    )
    verbose: bool = Field(
        False,
        json_schema_extra=FREE,
        description="Also show the libraries' own warnings and logs (hidden by default: they are about nothing you did).",
    )
