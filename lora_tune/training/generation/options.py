"""The options of GRPO's generation with vLLM (`--rollout vllm`): where the server is (or how to
start one), how long to wait for it, and TRL's off-policy correction for the numeric gap between
vLLM's sampling and the trainer's own log-probabilities. Names as TRL's GRPOConfig where it has them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from lora_tune.options import FREE, MATH, Options

ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class VLLMOptions(Options):
    """How --rollout vllm reaches vLLM (read by lora_tune.training.generation)."""

    section = "vLLM rollouts (--objective grpo --rollout vllm)"

    vllm_mode: Literal["server", "colocate"] = Field(
        "server",
        json_schema_extra=FREE,
        description="server: a vLLM OpenAI server (--vllm-url, or started by lora-tune with --vllm-python) gets the adapter each "
        "generation batch as a runtime LoRA, never the base's weights; colocate: a vLLM engine in this process (needs `import "
        "vllm` to work here), the adapter as a LoRA request.",
    )
    vllm_url: str = Field(
        "http://127.0.0.1:8000",
        json_schema_extra=FREE,
        description="server mode: the vLLM server's address (started with --enable-lora and runtime LoRA updating; a run that can't "
        "use it stops before loading and prints the command that starts the right one).",
    )
    vllm_python: str | None = Field(
        None,
        json_schema_extra=FREE,
        description="server mode: the Python interpreter of an environment where vLLM is installed; lora-tune starts the server "
        "with it on --vllm-url's port (its log: OUTPUT_DIR/vllm-server.log) and stops it when the run ends, fails or is "
        "interrupted.",
    )
    vllm_timeout: float = Field(
        600.0,
        gt=0,
        json_schema_extra=FREE,
        description="Seconds to wait for the server: its start, and each generation batch's completions; past it the run stops "
        "with one line, its last checkpoint kept.",
    )
    vllm_kv_cache_space: float = Field(
        1.0,
        gt=0,
        json_schema_extra=FREE,
        description="GiB of KV cache for a vLLM that lora-tune starts on a CPU (VLLM_CPU_KVCACHE_SPACE).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        json_schema_extra=FREE,
        description="colocate mode on a GPU: the share of its memory the vLLM engine takes (weights and KV cache); the engine "
        "sleeps (frees its KV cache) while the trainer steps.",
    )
    vllm_importance_sampling_correction: bool = Field(
        True,
        json_schema_extra=MATH,
        description="TRL's correction of the gap between vLLM's sampling log-probabilities and the trainer's: each completion's "
        "loss is weighted by exp(trainer - vLLM), truncated or masked per --vllm-importance-sampling-mode.",
    )
    vllm_importance_sampling_mode: ImportanceSamplingMode = Field(
        "sequence_mask",
        json_schema_extra=MATH,
        description="token_* weights each token by its own ratio, sequence_* each completion by the product over its tokens; "
        "*_truncate clamps the ratio to [clip-min, clip-max], *_mask sets it to 0 outside (TRL's default: sequence_mask).",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0, json_schema_extra=MATH, description="The importance ratio's lower bound (default: none)."
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0, gt=0, json_schema_extra=MATH, description="The importance ratio's upper bound (TRL's default 3)."
    )

    @field_validator("vllm_importance_sampling_clip_max")
    @classmethod
    def _above_clip_min(cls, high, info: ValidationInfo):
        low = info.data.get("vllm_importance_sampling_clip_min")
        if low is not None and high is not None and high <= low:
            raise ValueError(f"must be above --vllm-importance-sampling-clip-min {low} (got {high})")
        return high
