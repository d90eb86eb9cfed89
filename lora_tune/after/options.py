"""The options of after training: the serving engine a run must suit, and lm-eval tasks scored
during training; the configs of the after-training commands (merge, export, eval, check-serving,
report)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lora_tune.options import FREE, Options, size_text


class AfterTrainingOptions(Options):
    """Serving rules and lm-eval scores (read by lora_tune.after.serving and .evaluation)."""

    section = "after training"

    serve_with: Literal["vllm", "llama.cpp", "ollama"] | None = Field(
        None,
        json_schema_extra=FREE,
        description="Refuse, before loading, options that would make the adapter unservable by this engine (vLLM: DoRA, fused MoE expert "
        "targets, rank above 512; llama.cpp/ollama: DoRA, expert targets, families without a GGUF export). See `lora-tune check-serving`.",
    )
    eval_tasks: list[str] | None = Field(
        None,
        json_schema_extra=FREE,
        description="lm-evaluation-harness tasks (registry names or local task YAMLs, see --eval-tasks-include) scored at each evaluation "
        "and logged like eval loss. Needs lora-tune[eval].",
    )
    eval_tasks_limit: float | None = Field(
        None, gt=0, json_schema_extra=FREE, description="With --eval-tasks: at most this many examples per task (or a fraction if < 1)."
    )
    eval_tasks_include: str | None = Field(
        None,
        json_schema_extra=FREE,
        description="With --eval-tasks: a folder of lm-eval task YAMLs (with local data files) to add to the registry.",
    )


class MergeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    adapter: str = Field(description="Adapter folder written by `lora-tune train` (or any PEFT LoRA adapter).")
    base: str | None = Field(
        None,
        description="Base to merge into: alias, hub id or folder. Default: the base recorded in the adapter. Always its "
        "full-precision weights, also for adapters trained on 8-bit/4-bit bases.",
    )
    output: str = Field(description="Folder for the merged model (written to a temporary folder, renamed at the end).")
    dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16", description="Dtype of the merged weights (the arithmetic is fp32; one cast at the end)."
    )
    max_shard_size: str = Field("5GB", description="Largest output shard with its unit, e.g. 5GB or 500MB (a bare number is refused).")
    verify: bool = Field(True, description="Check merged weights for NaN/inf and compare merged vs base + adapter outputs.")
    overwrite: bool = Field(False, description="Replace a non-empty --output folder.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub during verification.")
    verbose: bool = Field(False, description="Also show the libraries' own warnings and logs.")

    _sizes = field_validator("max_shard_size", mode="before")(size_text)


class ReportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_dir: str = Field(description="Output folder of a training run (holds metrics.jsonl).")
    output: str | None = Field(None, description="Where to write the PNG (default: RUN_DIR/report.png).")


class ExportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        description="A training run's output folder (its adapter is merged into the full-precision base on the fly, "
        "streaming, as `merge` does) or a merged model folder."
    )
    format: Literal["gguf", "gguf-lora", "ollama"] = Field(
        "gguf",
        description="gguf: the whole model for llama.cpp / LM Studio; gguf-lora: the adapter alone as a llama.cpp LoRA "
        "adapter (a run folder); ollama: a folder with the GGUF and a Modelfile for `ollama create`.",
    )
    quant: Literal["f16", "bf16", "q8_0"] = Field(
        "f16",
        description="ggml type of the 2-D weights (norms and biases stay f32, as llama.cpp's converter writes them). "
        "gguf-lora: f16 or bf16 only.",
    )
    output: str = Field(
        description="FILE.gguf for gguf and gguf-lora, a folder for ollama. Written under a temporary name and renamed at the end."
    )
    base: str | None = Field(None, description="With a run folder: the base to merge into (default: the one recorded in the adapter).")
    verify: bool = Field(
        True,
        description="Read the file back (gguf's reader: tensors, shapes, metadata), rebuild the tokenizer from it and compare "
        "logits through transformers' GGUF loader against the merged model (models up to 100M parameters).",
    )
    overwrite: bool = Field(False, description="Replace an existing --output.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub while verifying.")
    verbose: bool = Field(False, description="Also show the libraries' own warnings and logs.")


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        description="A training run's output folder (the adapter is applied through peft, no merge needed) or a merged model folder."
    )
    tasks: list[str] = Field(
        description="lm-evaluation-harness tasks, comma-separated or repeated: registry names (offline: their datasets must "
        "be cached) or tasks defined by YAML files in --include."
    )
    include: str | None = Field(
        None,
        description="A folder of lm-eval task YAML files (with local data files: dataset_path json + data_files), added to "
        "the registry; works offline.",
    )
    limit: float | None = Field(
        None,
        gt=0,
        json_schema_extra={"hint": "leave it out to score every example"},
        description="At most this many examples per task (a fraction if < 1): quick checks, not reportable scores.",
    )
    base_too: bool = Field(False, description="Also score the base model (the one recorded in the adapter) and show both side by side.")
    num_fewshot: int | None = Field(None, description="Few-shot examples per prompt (default: each task's own).")
    batch_size: int = Field(1, gt=0, description="Examples per forward pass.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Weights dtype while scoring: auto = bf16 on a GPU, fp32 on CPU."
    )
    device: str | None = Field(None, description="cuda, cuda:1, cpu (default: the GPU when there is one).")
    output: str | None = Field(None, description="Where to write the results JSON (default: SOURCE/eval_results.json).")
    base: str | None = Field(
        None, description="With a run folder: the base to apply the adapter to (default: the one recorded in the adapter)."
    )
    trust_remote_code: bool = Field(False, description="Run model code shipped with a hub repo.")
    verbose: bool = Field(False, description="Also show the libraries' own warnings and logs.")

    @field_validator("tasks", mode="before")
    @classmethod
    def _split_tasks(cls, v):
        items = [v] if isinstance(v, str) else list(v or [])
        tasks = [t.strip() for item in items for t in str(item).split(",") if t.strip()]
        if not tasks:
            raise ValueError("give at least one task, e.g. --tasks hellaswag,arc_easy")
        return tasks


class CheckServingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        description="A training run's output folder (adapter_config.json + adapter_model.safetensors), any PEFT LoRA adapter, or a "
        "merged model folder (`lora-tune merge`: its tokenizer and, for image-text models, processor files are checked)."
    )
    engine: Literal["vllm", "llama.cpp", "ollama"] = Field("vllm", description="The serving engine to check the adapter against.")
    base: str | None = Field(
        None,
        description="The base the adapter will be served on (default: the one recorded in the adapter); its family decides "
        "the llama.cpp / Ollama rules.",
    )
    live: bool = Field(
        False,
        description="--engine vllm: also serve the adapter on a real vLLM, greedy-decode a few prompts and compare them token by "
        "token with transformers + peft (fp32); exit 1 when they differ within the first 8 tokens.",
    )
    vllm_python: str | None = Field(
        None, description="--live: the python of vLLM's environment, to start a server with (default: this one, if vLLM imports here)."
    )
    vllm_url: str | None = Field(None, description="--live: a running vLLM server of the base (runtime LoRA on) to use instead.")
    prompts: str | None = Field(None, description="--live: a text file of prompts, one a line (default: four built-in ones).")
    max_new_tokens: int = Field(32, gt=0, description="--live: tokens decoded per prompt.")
    verbose: bool = Field(False, description="Also show the libraries' own warnings and logs.")
