"""GRPO's completions from a vLLM engine in the trainer's own process (`--vllm-mode colocate`), the
adapter handed over as a LoRA request each generation batch (Unsloth's route): no server, no HTTP,
the base loaded a second time by vLLM. Each rank runs its own engine and generates its share.

It needs `import vllm` to work where lora-tune runs: vLLM pins its own transformers, so that is an
environment built for vLLM with lora-tune installed into it (the README's vLLM environment). On a
GPU the engine takes --vllm-gpu-memory-utilization of its memory and sleeps (its KV cache freed)
while the trainer steps.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time

import torch

from lora_tune.engines import ranks as dist
from lora_tune.errors import UserError
from lora_tune.training.generation import handover
from lora_tune.training.generation.registry import GenerationError, Sampled, cut_at_eos, special_ids
from lora_tune.training.generation.vllm_api import (
    RPC_ENV,
    VLLM_DTYPES,
    check_head_size,
    remove_rpc_folder,
    rpc_folder,
    sampling,
    vllm_max_lora_rank,
    vllm_seed,
)
from lora_tune.training.generation.vllm_server import needed_length

log = logging.getLogger("lora_tune")


def check_inputs(cfg, base_path: str, config, max_model_len: int) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "--vllm-mode colocate: vLLM is not installed in this environment (it pins its own transformers, so it usually lives in "
            "an environment of its own); run lora-tune from that environment, or use --vllm-mode server with --vllm-python PATH"
        )
    check_head_size(config, "--vllm-mode colocate", on_cpu=not torch.cuda.is_available())


class Engine:
    """The vLLM engine of this rank, built before the trainer loads the base."""

    def __init__(self, llm, adapters, sleeps: bool, rpc):
        self.llm, self.adapters, self.sleeps, self.rpc = llm, adapters, sleeps, rpc

    def close(self) -> None:
        self.llm = None  # vLLM shuts its engine core down when the LLM is collected
        handover.remove(self.adapters)  # every rank's copies: none outlives the run
        remove_rpc_folder(self.rpc)


def start(inputs) -> Engine:
    from vllm import LLM  # noqa: PLC0415 - optional: installed only in vLLM's environment (checked before loading)

    cfg = inputs.cfg
    cuda = torch.cuda.is_available()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cfg.vllm_kv_cache_space:g}")
    if not cfg.verbose:  # its engine's start-up and shutdown logs are not about anything the user did
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    rpc = rpc_folder()
    if rpc is not None:  # vLLM reads it when the engine starts: its sockets there, removed at close
        os.environ[RPC_ENV] = str(rpc)
    if dist.is_main():
        handover.clear(inputs.output_dir)
    dist.barrier()
    started = time.monotonic()
    options = dict(
        model=inputs.base_path,
        dtype=VLLM_DTYPES[cfg.precision],
        enable_lora=True,
        max_lora_rank=vllm_max_lora_rank(cfg.rank),
        max_loras=1,
        max_model_len=needed_length(inputs),
        seed=0,
        logprobs_mode="processed_logprobs",  # the sampled tokens' log-probabilities at the sampling temperature (TRL's)
        enforce_eager=True,
    )
    if cuda:
        options.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enable_sleep_mode=True)
    llm = LLM(**options)
    log.info("vLLM engine (colocated) built in %.0f s", time.monotonic() - started)
    if cuda:
        llm.sleep(level=1)  # the trainer loads and steps first
    return Engine(llm, handover.folder(inputs.output_dir), sleeps=cuda, rpc=rpc)


def create(inputs, model, engine, started: Engine) -> ColocatedGenerator:
    return ColocatedGenerator(inputs, model, engine, started)


class ColocatedGenerator:
    samples_off_policy = True

    def __init__(self, inputs, model, engine, vllm_engine: Engine):
        self.cfg, self.vllm = inputs.cfg, vllm_engine
        # Each rank's engine reads its own copy: ranks of several nodes don't share a folder.
        self.handover = handover.Handover(vllm_engine.adapters, model.peft_model, engine, every_rank=True)
        self.pad_id, self.eos_ids = special_ids(inputs.tokenizer, model)
        self.loaded: int | None = None

    def generate(self, index: int, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        from vllm import SamplingParams  # noqa: PLC0415 - optional: vLLM's environment only
        from vllm.lora.request import LoRARequest  # noqa: PLC0415 - optional: vLLM's environment only

        cfg, llm = self.cfg, self.vllm.llm
        later_turn = self.loaded == index + 1  # a batch's later turns (tools) use the adapter already loaded
        folder = self.handover.current if later_turn else self.handover.publish(index)  # collective: every rank writes its copy
        error, sampled = None, None
        try:
            if self.vllm.sleeps:
                llm.wake_up()
            # A new id per batch: vLLM caches adapters by id, and an id reused with another path serves the old weights.
            request = LoRARequest(f"gen{index}", index + 1, str(folder))
            params = [SamplingParams(n=1, seed=vllm_seed(seed), **sampling(cfg, self.eos_ids)) for seed in seeds]
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request, use_tqdm=False)
            sampled = []
            for out in outputs:
                done = out.outputs[0]
                ids = list(done.token_ids)
                logps = [step[token].logprob for step, token in zip(done.logprobs, ids)]
                sampled.append(cut_at_eos(ids, self.eos_ids, logps))
            if self.loaded is not None and not later_turn:
                llm.llm_engine.remove_lora(self.loaded)
            self.loaded = request.lora_int_id
            if self.vllm.sleeps:
                llm.sleep(level=1)
        except Exception as e:  # noqa: BLE001 - vLLM's own errors, said in one line on every rank
            error = f"the colocated vLLM engine failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        message = dist.first_message(error)
        if message is not None:
            raise GenerationError(message, "Fix what it says")
        self.handover.retire()
        return sampled

    def close(self) -> None:
        self.loaded = None
