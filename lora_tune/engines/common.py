"""What every engine does the same way: build the optimizer and the LR schedule, run autocast,
move a batch, sum an evaluation, write and read its rank's part of a checkpoint, and say what it
holds of the base. Engines compose these; none inherits from another."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import bitsandbytes as bnb
import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import GenerationConfig, get_scheduler

from lora_tune.engines import ranks as dist
from lora_tune.engines import state as state_files
from lora_tune.errors import UserError
from lora_tune.models.loading import attention_implementation, compute_dtype, load_base_model, load_config


def load_whole_base(cfg, base_path: str, device: torch.device):
    """The base loaded whole into this process (quantized as it streams in, with bitsandbytes), with
    the attention implementation this run resolved: what one device and every DDP rank hold."""
    attention = attention_implementation(cfg, load_config(base_path, cfg.trust_remote_code), device)
    return load_base_model(base_path, cfg.precision, device, cfg.trust_remote_code, cfg.allow_bin, attn_implementation=attention)


def param_groups(named, lr: float, loraplus_lr_ratio: float | None) -> list:
    """What the optimizer steps, from (name, tensor) pairs: the tensors (one group at --lr), or with
    LoRA+ peft's `create_loraplus_optimizer` grouping: B matrices and 1-d tensors (DoRA magnitudes)
    at ratio x lr, everything else (A matrices) at lr. Each group records its `lr_ratio`, which the
    checkpoint keeps, so a resumed schedule restores every group's own rate (resumed_scheduler)."""
    named = list(named)
    if loraplus_lr_ratio is None:
        return [p for _, p in named]
    b = [p for n, p in named if "lora_B" in n or p.ndim == 1]
    a = [p for n, p in named if not ("lora_B" in n or p.ndim == 1)]
    groups = ({"params": a, "lr": lr, "lr_ratio": 1.0}, {"params": b, "lr": lr * loraplus_lr_ratio, "lr_ratio": loraplus_lr_ratio})
    return [g for g in groups if g["params"]]  # DeepSpeed's ZeRO can't flatten an empty group


def build_optimizer(name: str, params, lr: float, weight_decay: float):
    """`params`: tensors, or param_groups' groups (each with its own lr)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw_8bit":
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "paged_adamw_8bit":
        # Paged states spill to host memory under pressure on CUDA; elsewhere bnb runs it unpaged.
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(name)


def warmup_steps(cfg, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def build_scheduler(cfg, optimizer, total_steps: int):
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.lr_scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps(cfg, total_steps), num_training_steps=total_steps)


def resumed_scheduler(cfg, scheduler, saved_schedule: dict) -> LambdaLR:
    """After a checkpoint's optimizer state is loaded: the moments and step counts are the
    checkpoint's, the hyperparameters this run's. Loading a state dict restores each param group's
    learning rate and weight decay as saved, so a changed --lr or --weight-decay (with
    --allow-config-change) would be ignored and the first resumed step would run at the old
    schedule's rate; instead both are set from the config, and the schedule this run built (its
    --lr-scheduler, warmup and length) is positioned at the step the checkpoint's schedule reached,
    each group's rate evaluated there. A group's own multiple of --lr (LoRA+'s B group: its
    `lr_ratio`, kept in the checkpoint) stays its own. With nothing changed, every value equals the
    saved one."""
    optimizer = scheduler.optimizer
    for group in optimizer.param_groups:
        group.update(initial_lr=cfg.lr * group.get("lr_ratio", 1.0), weight_decay=cfg.weight_decay)
    # Built at last_epoch = step - 1, a LambdaLR takes its initial step to `step` (torch's API).
    return LambdaLR(optimizer, scheduler.lr_lambdas, last_epoch=saved_schedule["last_epoch"] - 1)


def loss_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 has a narrow exponent range: its loss is scaled so small gradients don't flush to zero."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def clip_and_step(params, optimizer, scheduler, scaler, max_grad_norm: float, hooks=None) -> tuple[float, bool]:
    """The end of an optimizer step for an engine whose every rank holds every LoRA weight whole (one
    device, DDP after its all-reduce): clip, step the optimizer and the schedule; (grad norm, applied).
    A non-finite gradient norm skips the update (the fp16 scaler does this itself, where an overflow
    only lowers the scale). `hooks`: the adapter type's work around the step (AdaLoRA's penalty and
    rank allocation, lora_tune.models.adapter_types), or None."""
    # A step whose micro-batches never reached a trainable tensor (the vision tower's LoRA with no
    # image, an expert no token was routed to) gives it a zero gradient, as the sharded engines do:
    # AdamW's moments, step count and weight decay then advance for every tensor, so one process
    # takes the steps N ranks take.
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if scaler:
        scaler.unscale_(optimizer)
    if hooks:
        hooks.add_penalty_gradients()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf")))
    applied = math.isfinite(grad_norm)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    elif applied:
        optimizer.step()
    if hooks:
        hooks.after_step(applied)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm, applied


def autocast(precision: str, device: torch.device):
    """The compute dtype for matmuls of frozen weights and fp32 LoRA weights alike (fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype(precision))


def to_device(inputs: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}


@torch.no_grad()
def evaluate(module, batches, precision: str | None, device: torch.device) -> tuple[float, int]:
    """(summed loss, weight) of the loss module over the micro-batches: each is its own step
    (precision None: no autocast, the backend casts itself)."""
    module.eval()
    total, weight = 0.0, 0
    for batch in batches:
        inputs = {
            **batch.inputs,
            **{f"{name}_in_step": torch.tensor(float(n)) for name, n in batch.counts.items() if name != batch.normalizer},
        }
        with autocast(precision, device) if precision else contextlib.nullcontext():
            # A sequence-parallel slice may hold no label (its loss is 0, its weight 0).
            loss = module(**to_device(inputs, device), num_items_in_batch=max(batch.weight, 1))
        total += float(loss) * batch.weight
        weight += batch.weight
    module.train()
    return total, weight


@torch.no_grad()
def generate(
    module,
    input_ids,
    attention_mask,
    settings,
    logits_processor,
    precision: str | None,
    device: torch.device,
    synced: bool,
    pixel_inputs=None,
):
    """The policy's completions of a left-padded batch, [rows, prompt + new tokens], by the loss
    module's `generate` (base + adapter). Eval mode and eager (decoding changes the KV cache at every
    step: compiled layers would recompile). `synced`: every rank runs the same number of forward
    passes, whoever finishes first (ZeRO-3 and FSDP2 gather weights collectively in each);
    precision None: no autocast, the backend casts itself."""
    module.eval()
    try:
        with torch.compiler.set_stance("force_eager"), autocast(precision, device) if precision else contextlib.nullcontext():
            return module.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=settings,
                logits_processor=logits_processor,
                synced_gpus=synced,
                **to_device(pixel_inputs or {}, device),
            )
    finally:
        module.train()


def greedy(engine, prompts: list, max_new_tokens: int) -> list[list[int]]:
    """Greedy completions of tokenized prompts (`lora_tune.data.prompts.EvalPrompt`: ids, and an
    image-text prompt's pixel inputs) through an engine's `generate`, one prompt at a time (no
    padding to reason about; these are a few samples)."""
    settings = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True)
    outputs = []
    for prompt in prompts:
        x = torch.tensor([prompt.ids])
        outputs.append(engine.generate(x, torch.ones_like(x), settings, pixel_inputs=prompt.pixel_inputs)[0, len(prompt.ids) :].tolist())
    return outputs


def base_tensor_bytes(model) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole) of every tensor reachable from the frozen base:
    parameters as partitioned (a ZeRO-3 partition, an FSDP2 shard, or the tensor), buffers, and the
    extra state bitsandbytes hangs on layers and weights (int8 CB/SCB, NF4 quant states), each
    piece of memory counted once. This is the figure that shows whether a partition is real."""
    seen: set = set()
    local = full = 0

    def count(t, whole: int | None = None):
        nonlocal local, full
        if not torch.is_tensor(t) or t.device.type == "meta":
            return
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes) if nbytes else id(t)  # the same memory seen through two names
        if key in seen:
            return
        seen.add(key)
        local += nbytes
        full += whole if whole is not None else nbytes

    def count_quant_state(state):
        if state is not None:
            for t in state.as_dict().values():
                count(t)

    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                continue
            whole = getattr(p, "ds_numel", p.numel()) * p.element_size()
            if hasattr(p, "ds_tensor"):  # ZeRO-3: the partition, plus the data if kept gathered
                count(p.ds_tensor, whole)
                if p.data.numel():
                    count(p.data, 0)
            elif hasattr(p, "to_local"):  # FSDP2: the local shard
                count(p.to_local(), whole)
            else:
                count(p.data)
            for extra in ("CB", "SCB"):
                count(getattr(p, extra, None))
            count_quant_state(getattr(p, "quant_state", None))
        for b in module.buffers(recurse=False):
            count(b)
        if isinstance(module, bnb.nn.Linear8bitLt):
            count(module.state.CB)
            count(module.state.SCB)
        if isinstance(module, bnb.nn.Linear4bit):  # kept on the layer too (FSDP2's weight loses it)
            count_quant_state(getattr(module, "quant_state", None))
    return local, full


# --- checkpoints -----------------------------------------------------------------------------------
def state_name(kind: str) -> str:
    """This rank's file stem in a checkpoint: every engine writes one set per rank, pickle-free."""
    return f"{kind}_rank{dist.rank()}"


def save_rank_state(folder: Path, optimizer, scheduler, **extra) -> None:
    """Optimizer, schedule (and any extra state dicts) of this rank as safetensors + JSON, and its RNG."""
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), **extra}
    state_files.save_safe_state(folder, state_name("training_state"), state)
    state_files.save_rng(folder / f"{state_name('rng_state')}.safetensors")


def load_rank_state(folder: Path) -> dict:
    """What save_rank_state wrote for this rank; restores the RNG. The caller loads the state dicts
    into its optimizer and schedule (the backends differ in how)."""
    state = state_files.load_safe_state(folder, state_name("training_state"))
    state_files.load_rng(folder / f"{state_name('rng_state')}.safetensors")
    return state


def save_whole_state(folder: Path, optimizer, scheduler, scaler, hooks=None) -> None:
    """save_rank_state of an engine whose optimizer holds every LoRA weight whole (one device, DDP),
    with its fp16 loss scaler and the adapter type's step state (`hooks`) where it has them."""
    extra = {"scaler": scaler.state_dict()} if scaler else {}
    save_rank_state(folder, optimizer, scheduler, **extra, **({"adapter_steps": hooks.state_dict()} if hooks else {}))


def load_whole_state(folder: Path, cfg, optimizer, scheduler, scaler, hooks=None):
    """What save_whole_state wrote, loaded into the optimizer (and scaler, and step hooks); returns the
    schedule this run continues with (resumed_scheduler)."""
    state = load_rank_state(folder)
    optimizer.load_state_dict(state["optimizer"])
    if scaler and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if hooks:
        if "adapter_steps" not in state:
            raise UserError(f"{folder} holds no state of AdaLoRA's rank allocator; resume from a checkpoint of this run")
        hooks.load_state_dict(state["adapter_steps"])
    return resumed_scheduler(cfg, scheduler, state["scheduler"])


def memory_line(model, device: torch.device, offload: str, who: str, partitioned: tuple[int, int] | None) -> str:
    """One line on what this rank holds of the frozen base: its partition of the parameters (None:
    the whole base) and every tensor reachable from the base, each piece of memory counted once."""
    held, whole = base_tensor_bytes(model)
    where = "host (CPU offload)" if offload == "cpu" else str(device)
    if partitioned is None:
        return f"{who}: rank {dist.rank()} holds the whole base ({held:,} bytes of base tensors) on {where}"
    local, full = partitioned
    return f"{who}: rank {dist.rank()} holds {local:,} of {full:,} base parameters ({held:,} of {whole:,} bytes of base tensors) on {where}"
