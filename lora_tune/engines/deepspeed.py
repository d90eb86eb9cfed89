"""DeepSpeed ZeRO-1/2/3, optional CPU offload.

ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also the base weights: a bf16/fp32
base is built under `zero.Init` (transformers does it when a ZeRO-3 config is registered before
`from_pretrained`), so no rank ever holds the whole model. Our loss is already normalised over the
step's label tokens, so DeepSpeed must not divide it by the accumulation steps again
(scale_wrt_gas=False); DeepSpeed averages gradients over ranks, clips, and steps the optimizer and
schedule at the accumulation boundary.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import replace
from pathlib import Path

import torch

from lora_tune.engines import common
from lora_tune.engines import ranks as dist
from lora_tune.engines.spec import BackendSpec, ModelStates, Placement, divided, share
from lora_tune.errors import UserError
from lora_tune.models import layerwise
from lora_tune.models.adapter import load_adapter_weights, trainable_state_dict
from lora_tune.models.loading import attention_implementation, load_base_model, load_config

log = logging.getLogger("lora_tune")


def unlink_shared_allreduce_buffer() -> None:
    """DeepSpeed's CPU backend maps a 66 MB shared-memory buffer per rank
    (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>) and never unlinks it: every job
    would leave its buffers in RAM until reboot. Once every rank has mapped its peers' (done by the
    time init_distributed returns everywhere: the barrier), each removes its own name; the mappings
    live on until the processes exit, also when one is killed."""
    torch.distributed.barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{torch.distributed.get_rank()}"
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass  # a DeepSpeed build without the shared-memory op


def refusal(precision: str, stage: int, offload: str) -> str | None:
    if precision == "fp16":
        # DeepSpeed's fp16 mode casts the LoRA weights to fp16 under a loss scaler of its own; its
        # CPU backend has no fp16, so that path can't be tested here and is not offered.
        return (
            "fp16 under ZeRO needs DeepSpeed's own loss scaler, which is not wired (untestable without a GPU); "
            "use --precision bf16 (Ampere or newer) or --zero 0"
        )
    if offload == "nvme":
        # Tried with DeepSpeed 0.19 (libaio built): swapping parameters fails mid-forward ("Not
        # enough buffers", DeepSpeed #3062); swapping only optimizer states trains, but its
        # state_dict holds empty tensors for them and its loader reads swap files it has just
        # purged, so such a run could never resume.
        return (
            "DeepSpeed's NVMe swapping can't checkpoint and resume a LoRA run (swapped optimizer states don't reload; "
            "parameter swapping fails, DeepSpeed #3062); use --offload cpu"
        )
    return None


def loads_layer_by_layer(precision: str, stage: int) -> bool:
    # bf16/fp32 bases go through from_pretrained under zero.Init; quantized ones are streamed.
    return stage == 3 and precision in ("8bit", "4bit")


def place(states: ModelStates, stage: int, offload: str, world: int) -> Placement:
    """ZeRO-1 splits optimizer states, ZeRO-2 also gradients, ZeRO-3 also the base and the LoRA
    weights (plus the one layer it gathers for compute). CPU offload: DeepSpeed's CPU Adam keeps
    fp32 m, v and a fp32 master copy of each LoRA shard on the host (bitsandbytes' 8-bit states
    can't go there); ZeRO-3 also parks the base there, keeping the gathered and the prefetched layer."""
    device = share(states, world, optimizer=True, gradients=stage >= 2, weights=stage == 3, trainable=stage == 3, layers_in_flight=1)
    if offload != "cpu":
        return Placement(device)
    device = replace(device, optimizer=0)
    host_weights = 0
    if stage == 3:
        host_weights = device.weights - 2 * states.layer_weights
        device = replace(device, weights=2 * states.layer_weights)
    return Placement(device, host_optimizer=divided(12 * states.trainable_params, world), host_weights=host_weights)


def check_inputs(cfg) -> None:
    if cfg.zero_config and not Path(cfg.zero_config).is_file():
        raise UserError(f"--zero-config: {cfg.zero_config} does not exist")


SPEC = BackendSpec(
    name="deepspeed",
    engine="lora_tune.engines.deepspeed:DeepSpeedEngine",
    description="DeepSpeed ZeRO-1/2/3 (--zero), optional CPU offload",
    stages=(1, 2, 3),
    multi_process=True,
    default=False,
    refusal=refusal,
    loads_layer_by_layer=loads_layer_by_layer,
    label=lambda stage: f"ZeRO-{stage}",
    flags=lambda stage: ("--zero", str(stage)),
    place=place,
    # Measured and published costs of ZeRO's communication (DeepSpeed docs), and of CPU offload's
    # host-side optimizer and transfers (QLoRA paper, LLaMA-Factory's tables).
    slowdown=lambda stage, offload: {1: 1.02, 2: 1.05, 3: 1.2}[stage] * (1.6 if offload == "cpu" else 1.0),
    # ZeRO-3 gathers weights from hooks inside the layers: they split a compiled layer into many
    # graphs (9 instead of 2 over 4 tiny steps here, each step 4x slower than ZeRO-2's).
    compiles=lambda stage: stage in (1, 2),
    layer_by_layer_alternative="use --precision bf16 with --zero 3, or --zero 2",
    options=("zero_config",),
    check_inputs=check_inputs,
)


class DeepSpeedEngine:
    spec = SPEC
    skips_overflow = False

    def __init__(self, cfg, device: torch.device):
        if device.type == "cpu":  # said, so DeepSpeed doesn't detect it and warn about it at import
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: PLC0415 - optional dependency (the [deepspeed] extra), imported when this backend runs

        self.cfg = cfg
        self.device = device
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        if device.type == "cpu":
            unlink_shared_allreduce_buffer()
        self.config = deepspeed_config(cfg)
        self.zero3 = cfg.zero == 3

    # --- loading -------------------------------------------------------------------------------
    def load(self, base_path: str, add_adapter):
        import deepspeed  # noqa: PLC0415 - optional dependency (the [deepspeed] extra), imported when this backend runs

        cfg = self.cfg
        if self.zero3 and cfg.precision in ("8bit", "4bit"):
            base = self._load_quantized_partitioned(base_path)
        else:
            if self.zero3:
                # Must exist (and stay referenced) while from_pretrained runs: transformers then
                # builds the model under zero.Init, so each rank only ever holds its partition.
                self.hf_deepspeed = hf_deepspeed_config(self.config)
            base = load_base_model(
                base_path,
                cfg.precision,
                self.device,
                cfg.trust_remote_code,
                cfg.allow_bin,
                zero3=self.zero3,
                attn_implementation=attention_implementation(cfg, load_config(base_path, cfg.trust_remote_code), self.device),
            )
        self.model = add_adapter(base)
        if self.zero3 and self.model.chunk_size != 0:
            # The chunked loss reads the head's weight inside the loss module's forward, not through
            # the head's own forward: ZeRO-3 must gather it for the loss module.
            deepspeed.zero.register_external_parameter(self.model, self.model.get_base_model().get_output_embeddings().weight)
        return self.model

    def _load_quantized_partitioned(self, base_path: str):
        """Quantized weights can't be built under zero.Init (transformers skips it for them), so
        the base is streamed layer by layer: each decoder layer is read, quantized on the device
        (4-bit packed into bf16 words, 8-bit as lora_tune's shardable int8 layer) and partitioned
        with zero.Init(module=...) before the next one is read."""
        import deepspeed  # noqa: PLC0415 - optional dependency (the [deepspeed] extra), imported when this backend runs

        cfg = self.cfg
        skeleton, reader = layerwise.streamed_skeleton(
            base_path, cfg, self.device, f"--precision {cfg.precision} with --zero 3", "use --zero 2"
        )
        partition = lambda module: deepspeed.zero.Init(module=module, config_dict_or_path=self.config)  # noqa: E731
        layerwise.load_layer_by_layer(
            skeleton,
            reader,
            self.device,
            cfg.precision,
            init_adapter=lambda unit, name: None,
            partition=partition,
            partition_root=partition,
        )
        self.hf_deepspeed = hf_deepspeed_config(self.config)  # peft sees ZeRO-3 from here on
        return skeleton

    def _lora_params(self):
        return [p for _, p in self._named_lora_params()]

    def _named_lora_params(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def load_adapter(self, path: Path) -> None:
        if self.zero3:
            import deepspeed  # noqa: PLC0415 - optional dependency (the [deepspeed] extra), imported when this backend runs

            with deepspeed.zero.GatheredParameters(self._lora_params(), modifier_rank=0):
                load_adapter_weights(self.model.peft_model, path)
        else:
            load_adapter_weights(self.model.peft_model, path)

    def prepare(self, model, total_steps: int) -> None:
        import deepspeed  # noqa: PLC0415 - optional dependency (the [deepspeed] extra), imported when this backend runs

        cfg = self.cfg
        self.model = model
        params = common.param_groups(self._named_lora_params(), cfg.lr, cfg.loraplus_lr_ratio)
        if cfg.offload != "none":
            # Offloaded optimizer states live in host RAM and are stepped there: bitsandbytes'
            # 8-bit AdamW only runs where the states are on the device, so DeepSpeed's vectorised
            # CPU Adam (AdamW mode) does it; its op is compiled on first use and cached.
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 - optional dependency ([deepspeed])

            instead = "" if cfg.optim == "adamw" else f" ({cfg.optim} can't run on offloaded states)"
            log.info("optimizer: DeepSpeed's CPU Adam (AdamW mode) steps the offloaded states on the host%s", instead)
            optimizer = DeepSpeedCPUAdam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw_mode=True)
        else:
            optimizer = common.build_optimizer(cfg.optim, params, cfg.lr, cfg.weight_decay)
        scheduler = common.build_scheduler(cfg, optimizer, total_steps)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.config
        )
        self.pending = 0

    # --- steps ---------------------------------------------------------------------------------
    def forward_backward(self, batch, divisor: float) -> torch.Tensor:
        self.ds.train()
        with common.autocast(self.cfg.precision, self.device):
            loss = self.ds(**common.to_device(batch.inputs, self.device), num_items_in_batch=divisor)
        self.ds.backward(loss, scale_wrt_gas=False)
        self.pending += 1
        if self.pending < self.cfg.grad_accum:
            self.ds.step()  # not a boundary: DeepSpeed only counts the micro-step
        return loss.detach().float()

    def step(self) -> tuple[float, bool]:
        self.ds.step()  # the boundary: reduce, clip, optimizer and scheduler step, zero grads
        self.pending = 0
        norm = self.ds.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        return grad_norm, math.isfinite(grad_norm)

    def zero_grad(self) -> None:
        self.ds.zero_grad()
        self.pending = 0

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def evaluate(self, batches) -> tuple[float, int]:
        return common.evaluate(self.ds, batches, self.cfg.precision, self.device)  # ZeRO-3: collective

    def generate(self, input_ids, attention_mask, settings, logits_processor=None, pixel_inputs=None):
        # ZeRO-3 gathers each module's weights as it runs (collective): the ranks decode in lockstep.
        model, precision, synced = self.model, self.cfg.precision, self.zero3
        return common.generate(model, input_ids, attention_mask, settings, logits_processor, precision, self.device, synced, pixel_inputs)

    # --- checkpoints ---------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Under ZeRO-3 only the LoRA weights are gathered (never the base): saving costs the
        adapter's size, not the model's."""
        if self.zero3:
            import deepspeed  # noqa: PLC0415 - optional dependency (the [deepspeed] extra), imported when this backend runs

            with deepspeed.zero.GatheredParameters(self._lora_params(), modifier_rank=None):
                return trainable_state_dict(self.model.peft_model)
        return trainable_state_dict(self.model.peft_model)

    def save_state(self, folder: Path) -> None:
        common.save_rank_state(folder, self.optimizer, self.scheduler)

    def load_state(self, folder: Path) -> None:
        state = common.load_rank_state(folder)
        live = self.optimizer.state_dict()
        saved = state["optimizer"]
        for key, value in live.items():  # objects the safe format dropped: take the live ones
            if key in saved and (saved[key] is None or type(saved[key]) is not type(value)) and not torch.is_tensor(value):
                saved[key] = value
        # ZeRO takes the list of every rank's partition and picks its own by rank; each rank
        # saved and reloads only its own, so the list holds that one at every index.
        self.optimizer.load_state_dict([saved] * dist.world_size())
        self.scheduler = self.ds.lr_scheduler = common.resumed_scheduler(self.cfg, self.scheduler, state["scheduler"])
        replay_cpu_adam_steps(self.optimizer.optimizer)

    def memory_report(self) -> str | None:
        """What this rank holds of the frozen base: ZeRO-3 partitions it (quantized bases count
        their packed storage elements); the bytes count every tensor reachable from it."""
        partitioned = None
        if self.zero3:
            base = [p for p in self.model.parameters() if not p.requires_grad]
            partitioned = (sum(p.ds_tensor.ds_numel for p in base), sum(p.ds_numel for p in base))
        return common.memory_line(self.model, self.device, self.cfg.offload, f"zero-{self.cfg.zero}", partitioned)


def deepspeed_config(cfg) -> dict:
    config = json.loads(Path(cfg.zero_config).read_text()) if cfg.zero_config else {}
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = cfg.zero
    if cfg.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", **zero.get("offload_optimizer", {})}
        if cfg.zero == 3:
            zero["offload_param"] = {"device": "cpu", **zero.get("offload_param", {})}
    config["zero_optimization"] = zero
    # Explicit numbers: DeepSpeed's "auto" fill miscounts the world size on CPU.
    config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    config["gradient_accumulation_steps"] = cfg.grad_accum
    config["train_batch_size"] = cfg.micro_batch_size * cfg.grad_accum * dist.world_size()
    config["gradient_clipping"] = cfg.max_grad_norm
    # LoRA weights are fp32 already and autocast runs the compute dtype, so DeepSpeed keeps no
    # extra master copy and needs no loss scaler.
    config["bf16"] = {"enabled": False}
    config["fp16"] = {"enabled": False}
    config["zero_allow_untested_optimizer"] = True
    config.setdefault("steps_per_print", 10**9)
    return config


def hf_deepspeed_config(ds_config: dict):
    """Tell transformers (and peft) that ZeRO-3 is on; the object must stay referenced."""
    from transformers.integrations import HfDeepSpeedConfig  # noqa: PLC0415 - needs the optional deepspeed

    return HfDeepSpeedConfig(ds_config)


def replay_cpu_adam_steps(optimizer) -> None:
    """Make a resumed DeepSpeed CPU Adam continue bit for bit.

    Its C++ side keeps beta^t and advances it by one multiplication per step; a fresh optimizer
    loaded at step k would compute pow(beta, k + 1) instead, which differs in the last bits. Replaying
    the k multiplications on a one-element scratch tensor restores the exact value.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 - optional dependency ([deepspeed])

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return
    steps = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    scratch = [torch.zeros(1) for _ in range(4)]  # weight, grad, exp_avg, exp_avg_sq
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(
            optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], group["bias_correction"], *scratch
        )
