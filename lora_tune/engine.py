"""The engine: forward/backward, gradient clipping, optimizer and LR schedule on one device.

This is the seam between the training loop and how the math is executed. The loop only calls
`forward_backward`, `step`, `evaluate`, `state_dict` / `load_state_dict`; a DeepSpeed engine
implements the same methods, so the loop never branches on the backend.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from lora_tune.model_loading import compute_dtype

log = logging.getLogger("lora_tune")


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


class SingleDeviceEngine:
    def __init__(self, model, cfg, device: torch.device, total_steps: int):
        self.model = model
        self.cfg = cfg
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.params, cfg.lr, cfg.weight_decay)
        self.scheduler = build_scheduler(cfg, self.optimizer, total_steps)
        # fp16 has a narrow exponent range: scale the loss so small gradients don't flush to zero.
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
        self.autocast_dtype = None if cfg.precision == "fp32" else compute_dtype(cfg.precision)
        self.forward_module = model  # what runs forward: the model here, DeepSpeed's engine there

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _to_device(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def forward_backward(self, batch, num_label_tokens: int) -> torch.Tensor:
        """Backward of this micro-batch's share of the step loss.

        The loss is summed over tokens and divided by the label tokens of the *whole* step, so a
        step over several micro-batches equals one big batch exactly (no mean-of-means bias).
        Returns the detached share (their sum over a step is the step's mean token loss).
        """
        batch = self._to_device(batch)
        self.model.train()
        with self._autocast():
            out = self.model(**batch, num_items_in_batch=num_label_tokens)
        loss = out.loss
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach().float()

    def step(self) -> tuple[float, bool]:
        """Clip, step the optimizer and the schedule. Returns (grad norm, applied).

        A non-finite gradient norm skips the update (the scaler does this itself for fp16, where an
        overflow is routine and only lowers the scale).
        """
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        applied = math.isfinite(grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm, applied

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    @torch.no_grad()
    def evaluate(self, batches) -> tuple[float, int]:
        """(summed token loss, label tokens) over the given batches."""
        from lora_tune.data import label_tokens

        module = self.forward_module
        module.eval()
        total, tokens = 0.0, 0
        for batch in batches:
            n = label_tokens(batch)
            with self._autocast():
                out = module(**self._to_device(batch), num_items_in_batch=n)
            total += float(out.loss) * n
            tokens += n
        module.train()
        return total, tokens

    # --- checkpoint state -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class DeepSpeedEngine(SingleDeviceEngine):
    """The same interface over a DeepSpeed ZeRO engine (stage 2 or 3, optional CPU offload).

    Our loss is already normalised over the step's label tokens, so DeepSpeed must not divide it
    by the accumulation steps again (scale_wrt_gas=False); DeepSpeed averages gradients over
    ranks, clips, and steps the optimizer and schedule at the accumulation boundary.
    """

    def __init__(self, model, cfg, device: torch.device, total_steps: int, ds_config: dict):
        import deepspeed

        from lora_tune.distributed import is_main

        self.model = model
        self.cfg = cfg
        self.device = device
        self.params = [p for p in model.parameters() if p.requires_grad]
        if cfg.offload != "none":
            # Offloaded optimizer states live in host RAM and are stepped there:
            # bitsandbytes' 8-bit AdamW only runs where the states are on the device, so DeepSpeed's
            # vectorised CPU Adam (AdamW mode) does it; its op is compiled on first use and cached.
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            if is_main():
                instead = "" if cfg.optim == "adamw" else f" ({cfg.optim} can't run on offloaded states)"
                log.info("optimizer: DeepSpeed's CPU Adam (AdamW mode) steps the offloaded states on the host%s", instead)
            optimizer = DeepSpeedCPUAdam(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw_mode=True)
        else:
            optimizer = build_optimizer(cfg.optim, self.params, cfg.lr, cfg.weight_decay)
        scheduler = build_scheduler(cfg, optimizer, total_steps)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        self.scaler = None
        self.autocast_dtype = None if cfg.precision == "fp32" else compute_dtype(cfg.precision)
        self.pending = 0
        self.forward_module = self.ds

    def forward_backward(self, batch, num_label_tokens: int) -> torch.Tensor:
        batch = self._to_device(batch)
        self.ds.train()
        with self._autocast():
            out = self.ds(**batch, num_items_in_batch=num_label_tokens)
        self.ds.backward(out.loss, scale_wrt_gas=False)
        self.pending += 1
        if self.pending < self.cfg.grad_accum:
            self.ds.step()  # not a boundary: DeepSpeed only counts the micro-step
        return out.loss.detach().float()

    def step(self) -> tuple[float, bool]:
        self.ds.step()  # the boundary: reduce, clip, optimizer and scheduler step, zero grads
        self.pending = 0
        norm = self.ds.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        return grad_norm, math.isfinite(grad_norm)

    def zero_grad(self) -> None:
        self.ds.zero_grad()
        self.pending = 0

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        live = self.optimizer.state_dict()
        saved = state["optimizer"]
        for key, value in live.items():  # objects the safe format dropped: take the live ones
            if key in saved and (saved[key] is None or type(saved[key]) is not type(value)) and not torch.is_tensor(value):
                saved[key] = value
        from lora_tune.distributed import world_size

        # ZeRO takes the list of every rank's partition and picks its own by rank; each rank
        # saved and reloads only its own, so the list holds that one at every index.
        self.optimizer.load_state_dict([saved] * world_size())
        self.scheduler.load_state_dict(state["scheduler"])
        replay_cpu_adam_steps(self.optimizer.optimizer)


def replay_cpu_adam_steps(optimizer) -> None:
    """Make a resumed DeepSpeed CPU Adam continue bit for bit.

    Its C++ side keeps beta^t and advances it by one multiplication per step; a fresh optimizer
    loaded at step k would compute pow(beta, k + 1) instead, which differs in the last bits. Replaying
    the k multiplications on a one-element scratch tensor restores the exact value.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return
    steps = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    scratch = [torch.zeros(1) for _ in range(4)]  # weight, grad, exp_avg, exp_avg_sq
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], group["bias_correction"], *scratch)
