"""The options of the data room: the sources, how they are read, cut, tokenized, cached and packed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lora_tune.options import FREE, MATH, Options


class DataOptions(Options):
    """The training and evaluation data (read by lora_tune.data)."""

    section = "data"

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

    max_pixels: int = Field(
        1024 * 1024,
        gt=0,
        json_schema_extra=MATH,
        description="Image-text data: an image larger than this many pixels is scaled down (aspect kept) before the model's "
        "processor sees it, which bounds its image tokens and the vision tower's activations (default 1024 x 1024; processors "
        "with a fixed size, like Gemma 3's, resize anyway).",
    )
    min_pixels: int = Field(
        0,
        ge=0,
        json_schema_extra=MATH,
        description="Image-text data: an image smaller than this many pixels is scaled up (aspect kept); 0 leaves small images "
        "to the processor's own minimum.",
    )

    @field_validator("data", "eval_data", mode="before")
    @classmethod
    def _sources(cls, v):
        return [v] if isinstance(v, (str, dict)) else v

    @model_validator(mode="before")
    @classmethod
    def _weights_once(cls, values):
        """The mix's weights, resolved once: --data-weights over the file's data_weights (the flags
        win when the config is built) over each source's own `weight:`, which is then dropped, so the
        saved lora_tune_config.yaml states the mix the run uses."""
        if not isinstance(values, dict) or values.get("data_weights") is None or values.get("data") is None:
            return values
        data = values["data"]
        entries = [data] if isinstance(data, (str, dict)) else list(data)
        if not any(isinstance(e, dict) and "weight" in e for e in entries):
            return values
        unweighted = [{k: v for k, v in e.items() if k != "weight"} if isinstance(e, dict) else e for e in entries]
        return {**values, "data": unweighted}
