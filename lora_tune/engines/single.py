"""One process, one device: the base loads whole (quantized as it streams in, with bitsandbytes),
gradients and optimizer states stay with it."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lora_tune.engines import common
from lora_tune.engines.spec import BackendSpec, whole
from lora_tune.models.adapter import load_adapter_weights, trainable_state_dict
from lora_tune.models.loading import attention_implementation, load_base_model, load_config


def refusal(precision: str, stage: int, offload: str) -> str | None:
    if offload != "none":
        return "--offload needs a sharding backend: --zero 1|2|3 (DeepSpeed) or --backend fsdp"
    return None


SPEC = BackendSpec(
    name="single",
    engine="lora_tune.engines.single:SingleDeviceEngine",
    description="one process on one device (the default)",
    stages=(0,),
    multi_process=False,
    refusal=refusal,
    loads_layer_by_layer=lambda precision, stage: False,  # from_pretrained, whole
    label=lambda stage: "one device",
    flags=lambda stage: (),
    place=lambda states, stage, offload, world: whole(states),
    slowdown=lambda stage, offload: 1.0,
    compiles=lambda stage: True,
)


class SingleDeviceEngine:
    spec = SPEC

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.device = device
        # fp16 has a narrow exponent range: scale the loss so small gradients don't flush to zero.
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
        self.skips_overflow = self.scaler is not None

    # --- loading -------------------------------------------------------------------------------
    def load(self, base_path: str, add_adapter):
        cfg = self.cfg
        attention = attention_implementation(cfg, load_config(base_path, cfg.trust_remote_code), self.device)
        base = load_base_model(base_path, cfg.precision, self.device, cfg.trust_remote_code, cfg.allow_bin, attn_implementation=attention)
        self.model = add_adapter(base)
        return self.model

    def load_adapter(self, path: Path) -> None:
        load_adapter_weights(self.model.peft_model, path)

    def prepare(self, model, total_steps: int) -> None:
        self.model = model
        cfg = self.cfg
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        groups = common.param_groups(named, cfg.lr, cfg.loraplus_lr_ratio)
        self.optimizer = common.build_optimizer(cfg.optim, groups, cfg.lr, cfg.weight_decay)
        self.scheduler = common.build_scheduler(self.cfg, self.optimizer, total_steps)

    # --- steps ---------------------------------------------------------------------------------
    def forward_backward(self, batch, divisor: float) -> torch.Tensor:
        self.model.train()
        with common.autocast(self.cfg.precision, self.device):
            loss = self.model(**common.to_device(batch.inputs, self.device), num_items_in_batch=divisor)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach().float()

    def step(self) -> tuple[float, bool]:
        """Clip, step the optimizer and the schedule. A non-finite gradient norm skips the update
        (the scaler does this itself for fp16, where an overflow only lowers the scale)."""
        # A step whose micro-batches never reached a trainable tensor (the vision tower's LoRA with
        # no image, an expert no token was routed to) gives it a zero gradient, as the sharded engines
        # do: AdamW's moments, step count and weight decay then advance for every tensor, so one
        # process takes the steps N ranks take.
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
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

    def evaluate(self, batches) -> tuple[float, int]:
        return common.evaluate(self.model, batches, self.cfg.precision, self.device)

    def generate(self, input_ids, attention_mask, settings, logits_processor=None, pixel_inputs=None):
        model, precision = self.model, self.cfg.precision
        return common.generate(model, input_ids, attention_mask, settings, logits_processor, precision, self.device, False, pixel_inputs)

    # --- checkpoints ---------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return trainable_state_dict(self.model.peft_model)

    def save_state(self, folder: Path) -> None:
        extra = {"scaler": self.scaler.state_dict()} if self.scaler else {}
        common.save_rank_state(folder, self.optimizer, self.scheduler, **extra)

    def load_state(self, folder: Path) -> None:
        state = common.load_rank_state(folder)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler = common.resumed_scheduler(self.cfg, self.scheduler, state["scheduler"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def memory_report(self) -> str | None:
        return None
