"""One process, one device: the base loads whole (quantized as it streams in, with bitsandbytes),
gradients and optimizer states stay with it."""

from __future__ import annotations

from pathlib import Path

import torch

from lora_tune.engines import common
from lora_tune.engines.spec import BackendSpec, whole
from lora_tune.models.adapter import load_adapter_weights, trainable_state_dict
from lora_tune.models.adapter_types import registry as adapter_types


def refusal(precision: str, stage: int, offload: str) -> str | None:
    if offload != "none":
        return "--offload needs a sharding backend: --zero 1|2|3 (DeepSpeed) or --backend fsdp"
    return None


SPEC = BackendSpec(
    name="single",
    engine="lora_tune.engines.single:SingleDeviceEngine",
    description="one process on one device (the default with one process)",
    stages=(0,),
    multi_process=False,
    default=True,
    refusal=refusal,
    loads_layer_by_layer=lambda precision, stage: False,  # from_pretrained, whole
    label=lambda stage: "one device",
    flags=lambda stage: (),
    place=lambda states, stage, offload, world: whole(states),
    slowdown=lambda stage, offload: 1.0,
    compiles=lambda stage: True,
    whole_gradients=True,
)


class SingleDeviceEngine:
    spec = SPEC

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.scaler = common.loss_scaler(cfg.precision, device)
        self.skips_overflow = self.scaler is not None

    # --- loading -------------------------------------------------------------------------------
    def load(self, base_path: str, add_adapter):
        self.model = add_adapter(common.load_whole_base(self.cfg, base_path, self.device))
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
        self.step_hooks = adapter_types.step_hooks(cfg, model.peft_model, total_steps)  # AdaLoRA's allocator, else None

    # --- steps ---------------------------------------------------------------------------------
    def forward_backward(self, batch, divisor: float) -> torch.Tensor:
        self.model.train()
        with common.autocast(self.cfg.precision, self.device):
            loss = self.model(**common.to_device(batch.inputs, self.device), num_items_in_batch=divisor)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach().float()

    def step(self) -> tuple[float, bool]:
        return common.clip_and_step(self.params, self.optimizer, self.scheduler, self.scaler, self.cfg.max_grad_norm, self.step_hooks)

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
        common.save_whole_state(folder, self.optimizer, self.scheduler, self.scaler, self.step_hooks)

    def load_state(self, folder: Path) -> None:
        self.scheduler = common.load_whole_state(folder, self.cfg, self.optimizer, self.scheduler, self.scaler, self.step_hooks)

    def memory_report(self) -> str | None:
        return None
