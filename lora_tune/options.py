"""The typed configuration of a training run: one schema for YAML files, CLI flags and `--help`.

Every field here is a YAML key and a flag (`max_seq_len` <-> `--max-seq-len`); its description is the
help text. Fields are tagged by how they behave on `--resume`: "math" fields change what the run
computes and must match the checkpoint; the others (run length, cadence, reporting) may change.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lora_tune.errors import UserError, did_you_mean

# Base precisions and offload targets; which combinations run is each backend's call (lora_tune.engines).
Precision = Literal["fp32", "bf16", "fp16", "8bit", "4bit"]
Offload = Literal["none", "cpu", "nvme"]

MATH = {"resume_rule": "math"}  # changing it on resume changes the result: refused
FREE = {"resume_rule": "free"}  # run length, cadence, reporting, paths: may change on resume


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- model -------------------------------------------------------------------------------
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

    # --- LoRA --------------------------------------------------------------------------------
    rank: int = Field(16, gt=0, json_schema_extra={**MATH, "hint": "typical values are 8, 16, 32, 64"}, description="LoRA rank r.")
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
        json_schema_extra=MATH,
        description="Module names to adapt, e.g. q_proj v_proj. Default: every linear layer of the transformer blocks (never lm_head).",
    )
    rslora: bool = Field(False, json_schema_extra=MATH, description="Rank-stabilised LoRA scaling alpha / sqrt(r).")
    dora: bool = Field(False, json_schema_extra=MATH, description="Weight-decomposed LoRA (DoRA).")

    # --- data --------------------------------------------------------------------------------
    data: list[str | dict] = Field(
        min_length=1,
        json_schema_extra=MATH,
        description="Training data, one or more sources: a .jsonl/.json/.parquet/.csv file or folder, or a hub dataset (name "
        "or name:config:split). Columns decide the format: text | instruction/input/output | messages (OpenAI, tools) | "
        "conversations (ShareGPT) | prompt/completion | input_ids (pretokenized). In YAML a source may be a mapping of path, "
        "weight, columns, config, split.",
    )
    data_weights: list[float] | None = Field(
        None,
        json_schema_extra=MATH,
        description="Mix the --data sources in these proportions (one weight each; deterministic for --seed). Default: every "
        "row of every source once.",
    )
    data_columns: str | None = Field(
        None,
        json_schema_extra=MATH,
        description="Rename columns to the names a format expects, e.g. instruction=question,output=answer (every source).",
    )
    system_message: Literal["auto", "keep", "merge", "drop"] = Field(
        "auto",
        json_schema_extra=MATH,
        description="Chat data with a system message: keep it, merge it into the first user turn (for templates without a "
        "system role: Gemma, Mistral), or drop it. auto: keep where the chat template accepts it, else merge.",
    )
    eval_data: list[str | dict] | None = Field(None, json_schema_extra=MATH, description="Evaluation data, same formats as --data.")
    eval_split: float = Field(
        0.0,
        ge=0,
        lt=1,
        json_schema_extra=MATH,
        description="Fraction of --data held out for evaluation when --eval-data is not given (e.g. 0.05).",
    )
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
    max_seq_len: int = Field(2048, gt=0, json_schema_extra=MATH, description="Maximum tokens per sample.")
    long_samples: Literal["truncate", "drop"] = Field(
        "truncate", json_schema_extra=MATH, description="What to do with samples longer than --max-seq-len."
    )
    train_on_prompt: bool = Field(
        False, json_schema_extra=MATH, description="Also compute the loss on prompt / user tokens (default: only on the response)."
    )
    data_workers: int | None = Field(
        None, gt=0, json_schema_extra=FREE, description="Processes that tokenize large sources (default: the CPU count, at most 8)."
    )
    data_cache_dir: str | None = Field(
        None, json_schema_extra=FREE, description="Where tokenized data is cached (default: the datasets cache, under lora_tune/)."
    )
    data_cache: bool = Field(
        True,
        json_schema_extra=FREE,
        description="Cache tokenized data on disk and memory-map it (--no-data-cache: tokenize in memory every run).",
    )
    packing: bool = Field(
        True,
        json_schema_extra=MATH,
        description="Pack samples into rows of up to --max-seq-len tokens (best-fit decreasing; no attention across samples). "
        "Falls back to padded batches, with a log line, for models whose attention can't separate packed samples.",
    )
    group_by_length: bool = Field(
        True, json_schema_extra=MATH, description="Without packing: batch samples of similar length together to cut padding."
    )

    # --- optimisation ------------------------------------------------------------------------
    optim: Literal["adamw_8bit", "paged_adamw_8bit", "adamw"] = Field(
        "adamw_8bit",
        json_schema_extra=MATH,
        description="Optimizer: bitsandbytes 8-bit AdamW (default), its paged variant, or torch AdamW.",
    )
    lr: float = Field(
        2e-4, gt=0, json_schema_extra={**MATH, "hint": "LoRA usually trains with 1e-4 to 3e-4"}, description="Peak learning rate."
    )
    weight_decay: float = Field(0.0, ge=0, json_schema_extra=MATH, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, json_schema_extra=MATH, description="Linear warmup steps (overrides --warmup-ratio when > 0).")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, json_schema_extra=MATH, description="Warmup as a fraction of the total steps.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", json_schema_extra=MATH, description="Learning-rate schedule after warmup."
    )
    max_grad_norm: float = Field(1.0, ge=0, json_schema_extra=MATH, description="Clip the gradient norm to this (0 disables clipping).")
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
        "see the README for where it pays.",
    )
    loss_chunk_size: int | None = Field(
        None,
        ge=0,
        json_schema_extra={**FREE, "hint": "0 computes the full logits; leave it out for the automatic size"},
        description="Compute the output head and cross-entropy this many label tokens at a time, never materialising the "
        "whole [tokens x vocab] logits. Default: about tokens x hidden / vocab per chunk (logits no bigger than the hidden "
        "states), at least 128; 0: the model's own full-logits loss.",
    )
    attn_implementation: Literal["auto", "sdpa", "sdpa_packed", "flash_attention_2", "eager"] = Field(
        "auto",
        json_schema_extra=FREE,
        description="Attention kernels: auto = flash_attention_2 when installed on a supporting GPU; on a CPU with packing (and "
        "no --compile) sdpa_packed, SDPA once per packed sample instead of a masked row; else sdpa.",
    )
    micro_batch_size: int = Field(1, gt=0, json_schema_extra=MATH, description="Samples per forward/backward.")
    grad_accum: int = Field(1, gt=0, json_schema_extra=MATH, description="Micro-batches per optimizer step.")
    epochs: float = Field(1.0, gt=0, json_schema_extra=FREE, description="Passes over the data (ignored when --max-steps is given).")
    max_steps: int | None = Field(None, gt=0, json_schema_extra=FREE, description="Stop after this many optimizer steps.")
    seed: int = Field(42, json_schema_extra=MATH, description="Seed for data order, LoRA init and dropout.")
    max_bad_steps: int = Field(
        3,
        gt=0,
        json_schema_extra=FREE,
        description="Stop after this many consecutive steps with NaN/inf loss or gradient norm (those steps are skipped, and logged).",
    )

    # --- objective -----------------------------------------------------------------------------
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
    init_adapter: str | None = Field(
        None,
        json_schema_extra=MATH,
        description="Start from this adapter folder (e.g. an SFT run's output) instead of a fresh adapter; it is also the reference of "
        "dpo/ipo/kto. Its rank and targets become the run's.",
    )

    # --- distributed ---------------------------------------------------------------------------
    backend: str | None = Field(
        None,
        json_schema_extra={**MATH, "registry": "names"},
        description="Training engine (see the README's compatibility matrix); default: the backend whose stage --zero names, "
        "else one device.",
    )
    zero: int = Field(
        0,
        ge=0,
        json_schema_extra={**MATH, "registry": "stages"},
        description="DeepSpeed ZeRO stage (implies --backend deepspeed): 1 (shard optimizer states), 2 (also gradients), 3 "
        "(also the base weights, partitioned while loading); 0 = no DeepSpeed.",
    )
    offload: Offload = Field(
        "none",
        json_schema_extra=MATH,
        description="With ZeRO or FSDP: offload optimizer states (ZeRO-3 and FSDP: also weights) to host RAM (cpu); nvme is "
        "refused, with the reason.",
    )
    zero_config: str | None = Field(
        None,
        json_schema_extra=MATH,
        description="A full DeepSpeed JSON (bucket sizes, overlap, ...); batch sizes, clipping and the stage are set from the "
        "other options.",
    )
    nproc: int | None = Field(
        None,
        gt=0,
        json_schema_extra=FREE,
        description="Start N local processes (torchrun underneath). Not needed when launched by torchrun, deepspeed or accelerate.",
    )

    # --- output ------------------------------------------------------------------------------
    output_dir: str = Field(json_schema_extra=FREE, description="Where the adapter, checkpoints and metrics go.")
    save_steps: int | None = Field(
        None, gt=0, json_schema_extra=FREE, description="Write a checkpoint every N optimizer steps (default: only at the end)."
    )
    save_total_limit: int | None = Field(
        None, gt=0, json_schema_extra=FREE, description="Keep at most N checkpoints (the newest complete one is never removed)."
    )
    resume: bool = Field(False, json_schema_extra=FREE, description="Continue from the newest complete checkpoint in --output-dir.")
    allow_config_change: bool = Field(
        False, json_schema_extra=FREE, description="On --resume, accept a configuration or dataset that differs from the checkpoint's."
    )
    strict_memory: bool = Field(
        False, json_schema_extra=FREE, description="Refuse to start when the memory plan says the run will not fit (default: warn)."
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

    # --- after training -----------------------------------------------------------------------
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

    # --- validators: each message names the fix (bounds are the fields' own constraints) ---------
    @field_validator("data", "eval_data", mode="before")
    @classmethod
    def _sources(cls, v):
        return [v] if isinstance(v, (str, dict)) else v

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, v):
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v  # YAML true/false as before

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v):
        if v is not None and (not v or "lm_head" in v):
            raise ValueError("give module names such as q_proj v_proj (lm_head is never adapted); leave it out for all linear layers")
        return v

    # --- derived -----------------------------------------------------------------------------
    @property
    def lora_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @classmethod
    def math_keys(cls) -> list[str]:
        return [n for n, f in cls.model_fields.items() if (f.json_schema_extra or {}).get("resume_rule") == "math"]


def flag(name: str, field=None) -> str:
    """The CLI flag of a field: its name with dashes, unless the field names its own."""
    custom = (getattr(field, "json_schema_extra", None) or {}).get("flag")
    return custom or "--" + name.replace("_", "-")


def read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file {path} is a folder; pass a YAML file to --config")
    if not p.is_file():
        raise UserError(f"config file {path} does not exist; pass an existing YAML file to --config")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not text (not UTF-8); pass a YAML file to --config") from None
    except OSError as e:
        raise UserError(f"config file {path} is unreadable ({e.strerror or e})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}; fix the syntax") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"config file {path} must be a mapping of option: value")
    return loaded


def build_config(schema: type[BaseModel], file_values: dict[str, Any], flag_values: dict[str, Any], source: str = "config") -> BaseModel:
    """Merge defaults < YAML file < CLI flags and validate; every problem becomes a UserError."""
    known = schema.model_fields
    for key in file_values:
        if key not in known:
            raise UserError(f"unknown key '{key}' in {source}{did_you_mean(key, known)}; see --help for the options")
    merged = {**file_values, **flag_values}
    try:
        return schema(**merged)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "missing":
            raise UserError(f"{flag(name)} is required (or `{name}:` in the --config file)") from None
        got = err.get("input")
        field = schema.model_fields.get(name)
        if err["type"] in BOUND_ERRORS and field is not None:
            hint = (field.json_schema_extra or {}).get("hint") or ("leave it out to disable" if field.default is None else None)
            msg = f"must be {bounds(field)} (got {got})" + (f"; {hint}" if hint else "")
        elif err["type"] == "too_short":
            msg = f"give at least one value (got {got!r})"
        elif err["type"] == "literal_error" or "parsing" in err["type"] or err["type"].endswith("_type"):
            msg = f"got {got!r}; {err['msg'].lower()}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        raise UserError(f"{flag(name)}: {msg}") from None


BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def bounds(field) -> str:
    """A field's numeric constraints in words: 'a positive integer', 'in [0, 1)', '> 0', '>= 0'."""
    found = {}
    for m in field.metadata:
        for kind in ("gt", "ge", "lt", "le"):
            if isinstance(m, getattr(annotated_types, kind.capitalize())):
                found[kind] = getattr(m, kind)
    integer = field.annotation is int or int in getattr(field.annotation, "__args__", ())
    if found == {"gt": 0} and integer:
        return "a positive integer"
    low = f"[{found['ge']}" if "ge" in found else f"({found['gt']}" if "gt" in found else None
    high = f"{found['le']}]" if "le" in found else f"{found['lt']})" if "lt" in found else None
    if low and high:
        return f"in {low}, {high}"
    return " and ".join(f"{op} {found[k]}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if k in found)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, option: str, hint: str = "") -> int:
    """'5GB' -> 5_000_000_000, '100MiB' -> 104_857_600. A bare number is refused, not read as bytes:
    people type `24` for 24 GB, and 24 bytes is never what they meant."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if m and not m.group(2):
        raise UserError(f"{option}: {text!r} has no unit; write e.g. {m.group(1)}GB or {m.group(1)}GiB{hint}")
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{option}: {text!r} is not a size; write e.g. 5GB, 500MB or 80GiB{hint}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _size_text(v):
    """A size given as a number (YAML `gpu_memory: 24`, the API's gpu_memory=24) reaches parse_size,
    which refuses it with the hint, instead of failing as "not a string"."""
    return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


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

    _sizes = field_validator("max_shard_size", mode="before")(_size_text)


class ReportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_dir: str = Field(description="Output folder of a training run (holds metrics.jsonl).")
    output: str | None = Field(None, description="Where to write the PNG (default: RUN_DIR/report.png).")


class PlanConfig(TrainConfig):
    """`lora-tune plan` takes every `train` option (so a training YAML plans as it is) plus the
    hardware; data and output folder are not needed."""

    data: list[str | dict] | None = Field(
        None, json_schema_extra=MATH, description="Not needed for planning (accepted so a training config can be reused)."
    )
    output_dir: str | None = Field(None, json_schema_extra=FREE, description="Not needed for planning.")
    gpus: int = Field(1, gt=0, description="GPUs per node.")
    nodes: int = Field(1, gt=0, description="Nodes.")
    gpu_memory: str = Field(
        "a100-80",
        description="Memory per GPU: a size with its unit (80GB, 24GiB; a bare number such as 24 is refused, never read as bytes) "
        "or a GPU name: t4, l4, a10g, rtx3090, rtx4090, a100-40, a100-80, h100-80, h200 (also as people shorten them: 4090, "
        "h100, a100-80gb).",
    )
    cpu_memory: str | None = Field(
        None, description="Host memory per node with its unit (e.g. 512GB; a bare number is refused); checked when given."
    )
    print_json: bool = Field(False, json_schema_extra={"flag": "--json"}, description="Print the estimate as JSON (bytes per device).")
    auto: bool = Field(
        False, description="Search precision x ZeRO x offload x checkpointing x micro-batch for the fastest setup that fits."
    )

    _sizes = field_validator("gpu_memory", "cpu_memory", mode="before")(_size_text)


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
        description="A training run's output folder (adapter_config.json + adapter_model.safetensors) or any PEFT LoRA adapter."
    )
    engine: Literal["vllm", "llama.cpp", "ollama"] = Field("vllm", description="The serving engine to check the adapter against.")
    base: str | None = Field(
        None,
        description="The base the adapter will be served on (default: the one recorded in the adapter); its family decides "
        "the llama.cpp / Ollama rules.",
    )
    verbose: bool = Field(False, description="Also show the libraries' own warnings and logs.")
