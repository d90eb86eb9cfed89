"""Completions by transformers' `generate` on the training engine itself (every engine: under ZeRO-3
and FSDP2 the ranks generate in lockstep): the policy is the base with its adapter, never merged,
decoding with a KV cache over left-padded prompts.

Sampling is reproducible by construction: each completion draws its tokens from a generator seeded
by its seed, through the exponential race (argmax of p / E with E ~ Exp(1) picks token i with
probability p_i), so a completion does not depend on which other completions share its batch, and
a resumed run generates the same completions. Its log-probabilities are the trainer's own."""

from __future__ import annotations

import math

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from lora_tune.training.generation.registry import Sampled, cut_at_eos, special_ids


def check_inputs(cfg, base_path: str, config, max_model_len: int) -> None:
    """Nothing beyond the objective's own checks: the training engine generates."""


def start(inputs) -> None:
    return None


def create(inputs, model, engine, started) -> TransformersGenerator:  # noqa: ARG001 - the registry's signature
    return TransformersGenerator(inputs, model, engine)


class SeededSampling(LogitsProcessor):
    """Temperature, top-k and top-p as transformers' sampling applies them, then the token drawn
    from each row's own generator; the chosen token is left as the only finite score, so greedy
    decoding takes it."""

    def __init__(self, generators: list[torch.Generator], temperature: float, top_k: int, top_p: float):
        self.generators, self.temperature, self.top_k, self.top_p = generators, temperature, top_k, top_p

    def __call__(self, input_ids, scores):
        scores = scores.float() / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p < 1.0:  # smallest set of likeliest tokens whose mass reaches top_p (transformers' TopPLogitsWarper)
            ordered, order = torch.sort(scores, descending=False)
            mass = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = mass <= 1 - self.top_p
            drop[..., -1:] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), -math.inf)
        probs = scores.softmax(dim=-1)
        # E = -log U ~ Exp(1), from each row's uniform draws (6x faster than exponential_ on a CPU).
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        noise = uniform.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_().to(probs.device)
        chosen = (probs / noise).argmax(dim=-1, keepdim=True)
        return torch.full_like(scores, -math.inf).scatter_(1, chosen, 0.0)


class TransformersGenerator:
    samples_off_policy = False

    def __init__(self, inputs, model, engine):
        self.cfg, self.engine = inputs.cfg, engine
        self.pad_id, self.eos_ids = special_ids(inputs.tokenizer, model)

    @torch.no_grad()
    def generate(self, index: int, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        cfg = self.cfg
        width = max(map(len, prompts))
        batch = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for row, prompt in enumerate(prompts):
            batch[row, width - len(prompt) :] = torch.tensor(prompt)  # left padding: every prompt ends where generation starts
            mask[row, width - len(prompt) :] = 1
        settings = GenerationConfig(
            max_new_tokens=cfg.max_new_tokens,
            do_sample=False,
            use_cache=True,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        sampling = LogitsProcessorList([SeededSampling(generators, cfg.temperature, cfg.top_k, cfg.top_p)])
        out = self.engine.generate(batch, mask, settings, sampling)
        return [cut_at_eos(new, self.eos_ids) for new in out[:, width:].tolist()]

    def close(self) -> None:
        pass
