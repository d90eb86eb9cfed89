"""What every engine does the same way: build the optimizer and the LR schedule, run autocast,
move a batch, and sum an evaluation. Engines compose these; none inherits from another."""

from __future__ import annotations

import contextlib
import math

import torch

from lora_tune.model_loading import compute_dtype


def build_optimizer(name: str, params, lr: float, weight_decay: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb

    if name == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "paged_adamw_8bit":
        # Paged states spill to host memory under pressure on CUDA; elsewhere bnb runs it unpaged.
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(name)


def warmup_steps(cfg, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def build_scheduler(cfg, optimizer, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.lr_scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps(cfg, total_steps), num_training_steps=total_steps)


def autocast(precision: str, device: torch.device):
    """The compute dtype for matmuls of frozen weights and fp32 LoRA weights alike (fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype(precision))


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(module, batches, precision: str, device: torch.device) -> tuple[float, int]:
    """(summed token loss, label tokens) of `module` over the batches."""
    from lora_tune.data import label_tokens

    module.eval()
    total, tokens = 0.0, 0
    for batch in batches:
        n = label_tokens(batch)
        with autocast(precision, device):
            out = module(**to_device(batch, device), num_items_in_batch=n)
        total += float(out.loss) * n
        tokens += n
    module.train()
    return total, tokens
