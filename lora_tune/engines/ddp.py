"""Plain data parallelism: PyTorch's DistributedDataParallel over the LoRA weights alone.

Every rank loads the whole base as one device does (quantized as it streams in, with bitsandbytes)
and keeps it frozen and replicated; DDP is told to leave it out, so it neither broadcasts it at the
start nor buckets it, and all-reduces only the adapter's gradients (averaged over ranks), once per
optimizer step: the accumulation's other micro-batches run under `no_sync`. Each rank then holds
the whole optimizer state, the same on every rank, and checkpoints it like every backend
(`common.save_rank_state`: one pickle-free file per rank), so resume reads it back with the same
code. For LoRA on a base that fits one device this is the fastest multi-process setup: no DeepSpeed,
no gathering of weights, one all-reduce of the adapter's gradients per step.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from lora_tune.engines import common
from lora_tune.engines import ranks as dist
from lora_tune.engines.spec import BackendSpec, whole
from lora_tune.models.adapter import load_adapter_weights, trainable_state_dict
from lora_tune.models.adapter_types import registry as adapter_types

EXPERT_MODULE = re.compile(r"\.experts\.\d+\.")  # one module per expert (not a fused expert tensor)


def refusal(precision: str, stage: int, offload: str) -> str | None:
    if offload != "none":
        return "DDP keeps every state whole on each rank's device; to offload, shard them: --zero 1|2|3 or --backend fsdp"
    return None


SPEC = BackendSpec(
    name="ddp",
    engine="lora_tune.engines.ddp:DDPEngine",
    description="PyTorch DistributedDataParallel: the whole base on every rank, the adapter's gradients all-reduced "
    "(the default with several processes)",
    stages=(0,),  # nothing is sharded
    multi_process=True,
    default=True,
    refusal=refusal,
    loads_layer_by_layer=lambda precision, stage: False,  # from_pretrained, whole, on every rank
    label=lambda stage: "DDP",
    flags=lambda stage: ("--backend", "ddp"),
    place=lambda states, stage, offload, world: whole(states),
    # One all-reduce of the LoRA gradients per step (bucketed, overlapped with backward): less traffic
    # than ZeRO-1's reduce-scatter + all-gather of the same states.
    slowdown=lambda stage, offload: 1.01,
    compiles=lambda stage: True,  # DDP's hooks sit on the LoRA weights' gradients, outside the compiled layers
    whole_gradients=True,
)


class DDPEngine:
    spec = SPEC

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.device = device
        dist.join(device)
        # The scaler unscales the all-reduced gradients, the same on every rank: an overflowing step
        # is skipped by every rank alike.
        self.scaler = common.loss_scaler(cfg.precision, device)
        self.skips_overflow = self.scaler is not None

    # --- loading -------------------------------------------------------------------------------
    def load(self, base_path: str, add_adapter):
        self.model = add_adapter(common.load_whole_base(self.cfg, base_path, self.device))
        return self.model

    def load_adapter(self, path: Path) -> None:
        load_adapter_weights(self.model.peft_model, path)

    def prepare(self, model, total_steps: int) -> None:
        cfg = self.cfg
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # The frozen base and every buffer are each rank's own copy, loaded alike, and the LoRA weights
        # start alike (seeded by name): nothing is broadcast at start (init_sync) or before each
        # forward (broadcast_buffers), and only the weights that train have gradients to reduce.
        self.ddp = DistributedDataParallel(
            model,
            init_sync=False,
            broadcast_buffers=False,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            # LoRA weights a micro-batch may not reach: the vision tower's (--train-vision on data
            # without images), those of separate expert modules (no token routed to one). DDP must
            # then find them unused (a graph traversal per step) rather than wait for their
            # gradients; every other LoRA weight is reached by every micro-batch (fused experts are
            # one tensor), so the traversal is spared.
            find_unused_parameters=cfg.train_vision or any(EXPERT_MODULE.search(n) for n, p in model.named_parameters() if p.requires_grad),
            gradient_as_bucket_view=True,  # the gradients live in DDP's buckets: no second copy
        )
        # LoRA+ (--loraplus-lr-ratio): B's own group at R x lr, as on every backend.
        groups = common.param_groups(named, cfg.lr, cfg.loraplus_lr_ratio)
        self.optimizer = common.build_optimizer(cfg.optim, groups, cfg.lr, cfg.weight_decay)
        self.scheduler = common.build_scheduler(cfg, self.optimizer, total_steps)
        self.step_hooks = adapter_types.step_hooks(cfg, model.peft_model, total_steps)  # AdaLoRA's allocator, else None
        self.pending = 0

    # --- steps ---------------------------------------------------------------------------------
    def forward_backward(self, batch, divisor: float) -> torch.Tensor:
        # A step is grad_accum calls (the Engine protocol), counted here.
        self.pending += 1
        self.ddp.train()
        # Only the last one's backward all-reduces (DDP's hooks fire as the gradients become ready).
        with self.ddp.no_sync() if self.pending < self.cfg.grad_accum else contextlib.nullcontext():
            with common.autocast(self.cfg.precision, self.device):
                loss = self.ddp(**common.to_device(batch.inputs, self.device), num_items_in_batch=divisor)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach().float()

    def step(self) -> tuple[float, bool]:
        self.pending = 0
        return common.clip_and_step(self.params, self.optimizer, self.scheduler, self.scaler, self.cfg.max_grad_norm, self.step_hooks)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def evaluate(self, batches) -> tuple[float, int]:
        return common.evaluate(self.model, batches, self.cfg.precision, self.device)  # each rank its own: nothing to gather

    def generate(self, input_ids, attention_mask, settings, logits_processor=None, pixel_inputs=None):
        # Each rank decodes its share with its own whole copy: no lockstep.
        model, precision = self.model, self.cfg.precision
        return common.generate(model, input_ids, attention_mask, settings, logits_processor, precision, self.device, False, pixel_inputs)

    # --- checkpoints ---------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return trainable_state_dict(self.model.peft_model)  # whole on every rank, the same

    def save_state(self, folder: Path) -> None:
        common.save_whole_state(folder, self.optimizer, self.scheduler, self.scaler, self.step_hooks)

    def load_state(self, folder: Path) -> None:
        self.scheduler = common.load_whole_state(folder, self.cfg, self.optimizer, self.scheduler, self.scaler, self.step_hooks)

    def memory_report(self) -> str | None:
        return common.memory_line(self.model, self.device, self.cfg.offload, "ddp", None)
