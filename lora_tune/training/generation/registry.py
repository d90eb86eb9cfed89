"""The ways GRPO's completions are generated, behind one protocol: the rollout asks a `Generator`
for the new tokens of a batch of prompts, each with its own seed, and never asks which one runs.

A generator is one module with `check_inputs` (before anything loads: its options, the server it
talks to), `start` (the run's output folder is locked, the base not loaded yet: a server to start or
probe; returns what `create` is given, or None) and a class built once the model is loaded."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Protocol

from lora_tune.data.batching import pad_token_id

log = logging.getLogger("lora_tune")

GENERATORS = {
    "transformers": "lora_tune.training.generation.transformers_generate",
    "vllm-server": "lora_tune.training.generation.vllm_server",
    "vllm-colocate": "lora_tune.training.generation.vllm_colocate",
}


@dataclass
class Sampled:
    """One completion as sampled: its new tokens up to and including the first EOS, whether it ran
    out of --max-new-tokens first, and the sampler's log-probability of each token where the
    sampler is not the trainer itself (vLLM; None for transformers, whose are the trainer's)."""

    ids: list[int]
    clipped: bool
    logps: list[float] | None = None


class GenerationError(Exception):
    """The generator failed mid-run (a server that stopped answering, a request past --vllm-timeout):
    one line saying what, and `advice`, what to do before --resume."""

    def __init__(self, message: str, advice: str):
        super().__init__(message)
        self.advice = advice


class Generator(Protocol):
    samples_off_policy: bool  # its log-probabilities differ from the trainer's (importance sampling corrects them)

    def generate(self, index: int, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        """The completions of generation batch `index`: one per prompt row (the rows of a group repeat
        their prompt), each sampled with its own seed; the same on every call with the same arguments."""

    def close(self) -> None: ...


def special_ids(tokenizer, model) -> tuple[int, set[int]]:
    """(the padding id, every id that ends a completion: the tokenizer's EOS and the generation
    config's) of the loss module's base."""
    pad_id = pad_token_id(tokenizer)
    extra = getattr(model.get_base_model().generation_config, "eos_token_id", None)
    eos_ids = {tokenizer.eos_token_id, *(extra if isinstance(extra, list) else [extra] if extra is not None else [])} - {None}
    return pad_id, eos_ids


def cut_at_eos(new: list[int], eos_ids: set[int], logps: list[float] | None = None) -> Sampled:
    """A completion up to and including its first EOS (what follows is padding or past the end);
    clipped when it has none."""
    end = next((k for k, t in enumerate(new) if t in eos_ids), None)
    if end is None:
        return Sampled(new, True, logps)
    return Sampled(new[: end + 1], False, None if logps is None else logps[: end + 1])


def name(cfg) -> str:
    return "transformers" if cfg.rollout == "transformers" else f"vllm-{cfg.vllm_mode}"


def module(cfg):
    return importlib.import_module(GENERATORS[name(cfg)])


def check_inputs(cfg, base_path: str, config, max_model_len: int) -> None:
    """The generator's own checks, before anything loads; and what vLLM serves of a quantized base."""
    module(cfg).check_inputs(cfg, base_path, config, max_model_len)
    if cfg.rollout == "vllm" and cfg.precision in ("8bit", "4bit"):
        log.info(
            "--rollout vllm: the %s base is served by vLLM from its checkpoint in bfloat16 (vLLM doesn't run bitsandbytes' layers "
            "here); the importance-sampling correction weighs the difference from the trainer's %s log-probabilities",
            cfg.precision,
            cfg.precision,
        )


def start(inputs):
    """Before the base loads, with the output folder locked: what the generator needs running
    (vLLM's server started or probed), or None."""
    return module(inputs.cfg).start(inputs) if inputs.objective.online else None


def create(inputs, model, engine, started) -> Generator:
    return module(inputs.cfg).create(inputs, model, engine, started)
