"""PyTorch FSDP2: `fully_shard` per decoder layer and on the root, optional CPU offload.

Weights, LoRA weights, gradients and optimizer states are all split across ranks (like ZeRO-3).
The base is streamed in layer by layer (`lora_tune.models.layerwise`): each decoder layer is read,
quantized when 4-bit, given its LoRA weights and sharded before the next is read, so no rank and
no host ever holds the whole model. bf16 runs under a mixed-precision policy (weights gathered and
computed in bf16, gradients reduced in fp32) while the LoRA weights stay fp32 in their shards.

The optimizer steps each rank's local shards directly (plain tensors that share the shards'
storage). That lets bitsandbytes' 8-bit AdamW, which can't take DTensors, run here too, and keeps
the checkpointed optimizer state plain per-rank tensors (safetensors, no pickle).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import distribute_tensor

from lora_tune.engines import common
from lora_tune.engines import ranks as dist
from lora_tune.engines.spec import BackendSpec, ModelStates, Placement, share
from lora_tune.errors import UserError
from lora_tune.models import layerwise
from lora_tune.models.adapter import materialize_adapter, read_adapter, trainable_state_dict


def refusal(precision: str, stage: int, offload: str) -> str | None:
    if precision == "fp16":
        return "fp16 needs a loss scaler, which FSDP2 runs don't wire; use --precision bf16 (Ampere or newer)"
    if offload == "nvme":
        return "FSDP2 offloads to host memory only; use --offload cpu"
    return None


def place(states: ModelStates, stage: int, offload: str, world: int) -> Placement:
    """Everything is split (like ZeRO-3), plus two whole layers: the one computing and the next,
    whose all-gather FSDP2 prefetches. CPUOffloadPolicy keeps the shards of the base, the LoRA
    weights, gradients and optimizer states on the host, and the optimizer steps there; the
    device keeps the layers in flight."""
    device = share(states, world, weights=True, trainable=True, gradients=True, optimizer=True, layers_in_flight=2)
    if offload != "cpu":
        return Placement(device)
    in_flight = 2 * states.layer_weights
    return Placement(
        replace(device, weights=in_flight, trainable=0, gradients=0, optimizer=0),
        host_optimizer=device.trainable + device.gradients + device.optimizer,
        host_weights=device.weights - in_flight,
    )


SPEC = BackendSpec(
    name="fsdp",
    engine="lora_tune.engines.fsdp:FSDPEngine",
    description="PyTorch FSDP2: shards weights, gradients and optimizer states (fully_shard per layer), optional CPU offload",
    stages=(0,),  # FSDP2 has no stages: it always shards weights, gradients and states
    multi_process=True,
    default=False,
    refusal=refusal,
    loads_layer_by_layer=lambda precision, stage: True,
    label=lambda stage: "FSDP2",
    flags=lambda stage: ("--backend", "fsdp"),
    place=place,
    # All-gathers per layer like ZeRO-3, overlapped by FSDP2's prefetch; CPU offload as for ZeRO.
    slowdown=lambda stage, offload: 1.15 * (1.6 if offload == "cpu" else 1.0),
    compiles=lambda stage: True,  # FSDP2's hooks run outside the compiled layer (Dynamo skips them)
    layer_by_layer_alternative="use --zero 3 with --precision bf16 (zero.Init through from_pretrained)",
)


class FSDPEngine:
    spec = SPEC
    skips_overflow = False

    def __init__(self, cfg, device: torch.device):
        self.cfg = cfg
        self.device = device
        dist.join(device)
        self.mesh = init_device_mesh(device.type, (dist.world_size(),))

    # --- loading -------------------------------------------------------------------------------
    def _policies(self) -> dict:
        kwargs = {"mesh": self.mesh}
        if self.cfg.precision in ("bf16", "4bit", "8bit"):
            # Gather and compute in bf16 (4-bit weights are bf16 words already; int8 values are
            # exact in bf16, so an 8-bit shard rests in 1 byte per weight and travels in 2); the fp32
            # LoRA shards are what the optimizer updates, and gradients are reduced in fp32.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # Pinned host memory only exists next to a GPU.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cfg.offload == "cpu" else OffloadPolicy()
        return kwargs

    def load(self, base_path: str, add_adapter):
        cfg = self.cfg
        # NF4 packed into bf16 words, so FSDP2 shards it like any bf16 tensor; 8-bit layers that keep
        # their int8 matrix only in the (sharded) parameter (lora_tune.models.int8_sharded).
        skeleton, reader = layerwise.streamed_skeleton(
            base_path, cfg, self.device, "--backend fsdp", "use --zero 3 with --precision bf16, or --zero 2"
        )
        model = add_adapter(skeleton)
        policies = self._policies()
        seed, init, reset = model.peft_model.lora_tune_seed, model.peft_model.lora_tune_init, model.peft_model.lora_tune_reset
        # Offloaded shards live on the host; the layers are still filled (and quantized) on the device.
        layerwise.load_layer_by_layer(
            model,
            reader,
            self.device,
            cfg.precision,
            # LoRA values are seeded by layer name within the peft model, as on every backend. The
            # root comes last as the wrapper itself: its LoRA layers (an image-text model's vision
            # tower under --train-vision) are named from the peft model inside it.
            init_adapter=lambda unit, name: (
                materialize_adapter(unit.peft_model, "", seed, self.device, init, reset)
                if unit is model
                else materialize_adapter(unit, name.removeprefix("peft_model."), seed, self.device, init, reset)
            ),
            partition=lambda layer: fully_shard(layer, **policies),
            partition_root=lambda root: fully_shard(root, **policies),
        )
        # Rollouts and sample prompts decode through the root's `generate`: FSDP2 runs its root hooks
        # (lazy initialisation, gathering the root's weights) around it as around a forward, which
        # matters when generation comes before any training forward (GRPO's first step).
        register_fsdp_forward_method(model, "generate")
        self.model = model
        return model

    def _lora_params(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def load_adapter(self, path: Path) -> None:
        """The saved (whole) adapter, split into this rank's shards."""
        file = path / "adapter_model.safetensors"
        saved = read_adapter(self.model.peft_model, file)
        for name, p in self._lora_params():
            key = name.removeprefix("peft_model.").replace(".default", "")
            if key not in saved:
                raise UserError(f"{file} does not match this LoRA configuration ({key} missing)")
            shard = distribute_tensor(saved[key].to(p.device, p.dtype), p.device_mesh, p.placements)
            with torch.no_grad():
                p.to_local().copy_(shard.to_local())

    def prepare(self, model, total_steps: int) -> None:
        cfg = self.cfg
        self.model = model
        named = self._lora_params()
        self.params = [p for _, p in named]
        # The optimizer sees each shard as a plain tensor (same storage): see the module docstring.
        self.local = [p.to_local().detach() for p in self.params]
        groups = common.param_groups([(n, local) for (n, _), local in zip(named, self.local)], cfg.lr, cfg.loraplus_lr_ratio)
        self.optimizer = common.build_optimizer(cfg.optim, groups, cfg.lr, cfg.weight_decay)
        self.scheduler = common.build_scheduler(cfg, self.optimizer, total_steps)

    # --- steps ---------------------------------------------------------------------------------
    def forward_backward(self, batch, divisor: float) -> torch.Tensor:
        self.model.train()
        # fp32 runs as is; bf16, 8-bit and 4-bit compute in bf16 through the mixed-precision policy.
        loss = self.model(**common.to_device(batch.inputs, self.device), num_items_in_batch=divisor)
        loss.backward()
        return loss.detach().float()

    def step(self) -> tuple[float, bool]:
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grads = [p for p in self.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)  # over the DTensor shards: collective
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        applied = math.isfinite(grad_norm)
        if applied:
            for p, local in zip(self.params, self.local):
                local.grad = p.grad.to_local().detach() if p.grad is not None else None
            self.optimizer.step()
        self.zero_grad()
        self.scheduler.step()
        return grad_norm, applied

    def zero_grad(self) -> None:
        for p, local in zip(self.params, self.local):
            p.grad = None
            local.grad = None

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def evaluate(self, batches) -> tuple[float, int]:
        return common.evaluate(self.model, batches, None, self.device)  # collective

    def generate(self, input_ids, attention_mask, settings, logits_processor=None, pixel_inputs=None):
        # The root's `generate` is one of its forward methods (see load): the root's own weights
        # (embeddings, head) are gathered around it, each decoder layer's as it runs (collective: the
        # ranks decode in lockstep).
        return common.generate(self.model, input_ids, attention_mask, settings, logits_processor, None, self.device, True, pixel_inputs)

    # --- checkpoints ---------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Only the LoRA shards are gathered (small), never the base; with them the adapter's own
        model-level buffers, whole on every rank (VeRA's shared projections, saved with it)."""
        full = {n.removeprefix("peft_model."): p.full_tensor().detach().cpu() for n, p in self._lora_params()}
        for n, b in self.model.peft_model.named_buffers(remove_duplicate=False):
            if not n.startswith("base_model.model."):
                full[n] = b.detach().cpu()
        return trainable_state_dict(self.model.peft_model, full)

    def save_state(self, folder: Path) -> None:
        common.save_rank_state(folder, self.optimizer, self.scheduler)

    def load_state(self, folder: Path) -> None:
        state = common.load_rank_state(folder)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler = common.resumed_scheduler(self.cfg, self.scheduler, state["scheduler"])

    def memory_report(self) -> str | None:
        base = [p for p in self.model.parameters() if not p.requires_grad]
        partitioned = (sum(p.to_local().numel() for p in base), sum(p.numel() for p in base))
        return common.memory_line(self.model, self.device, self.cfg.offload, "fsdp", partitioned)
