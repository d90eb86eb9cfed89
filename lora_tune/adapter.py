"""Inject LoRA adapters (peft) into the frozen base, and write them out in peft's layout."""

from __future__ import annotations

from pathlib import Path

import torch

from lora_tune.errors import UserError


def default_target_modules(model) -> list[str]:
    """Short names of every linear layer inside the transformer blocks (q_proj, ..., down_proj).

    bitsandbytes' Linear8bitLt / Linear4bit subclass nn.Linear, so quantised bases resolve the same.
    The output head and anything outside the blocks are left out on purpose.
    """
    names = set()
    for full_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{full_name}" and "lm_head" not in full_name:
            names.add(full_name.rsplit(".", 1)[-1])
    if not names:
        raise UserError("no linear layers found inside the transformer blocks; pass --target-modules explicitly")
    return sorted(names)


def lora_config(cfg, target_modules: list[str]):
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_modules,
        use_rslora=cfg.rslora,
        use_dora=cfg.dora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def check_target_modules(model, target_modules: list[str]) -> None:
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in target_modules if t not in present]
    if missing:
        linear = default_target_modules(model)
        raise UserError(f"--target-modules: {', '.join(missing)} not found in this model; its linear layers are {' '.join(linear)}")


def add_lora(model, cfg, base_id: str):
    """Wrap the base with trainable LoRA layers (fp32), checkpointing set up for peft.

    Returns the PeftModel; only LoRA (and DoRA magnitude) parameters require grad.
    """
    from peft import get_peft_model

    targets = cfg.target_modules or default_target_modules(model)
    check_target_modules(model, targets)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing computes grads for LoRA weights even though the block inputs
        # come from frozen embeddings; input grads are enabled too, so the reentrant path used by
        # some remote-code models doesn't hit "element 0 does not require grad" (transformers #42489).
        kwargs = {"use_reentrant": False}
        offload = getattr(cfg, "activation_offload", False)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
            # offload: transformers keeps the checkpointed layer inputs in pinned host memory.
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.enable_input_require_grads()
    peft_model = get_peft_model(model, lora_config(cfg, targets))
    peft_model.peft_config["default"].base_model_name_or_path = base_id
    peft_model.lora_tune_seed = cfg.seed
    for name, layer in lora_layers(peft_model):
        if not is_meta(layer):  # a meta skeleton gets its values layer by layer (lora_tune.layerwise)
            init_lora_layer(layer, name, cfg.seed)
    to_fp32(peft_model)
    torch.manual_seed(cfg.seed)  # dropout draws from here: part of the seeded math
    return peft_model


def to_fp32(module) -> None:
    for p in module.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # LoRA trains in fp32 whatever the base is stored in


def lora_layers(module, prefix: str = ""):
    """(full name, layer) of every LoRA layer inside `module`."""
    from peft.tuners.lora import LoraLayer

    for name, m in module.named_modules(prefix=prefix):
        if isinstance(m, LoraLayer):
            yield name, m


def is_meta(layer) -> bool:
    return any(p.device.type == "meta" for p in layer.lora_A.parameters())


def init_lora_layer(layer, name: str, seed: int) -> None:
    """LoRA's initial values (A: peft's Kaiming uniform, B: zeros; DoRA: the base weight's row
    norms) from a generator seeded by the run's seed and the layer's name. The same values come out
    whichever order or process initialises the layers, so every backend starts from the same adapter,
    also when the base is filled layer by layer after being sharded."""
    import zlib

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        layer.reset_lora_parameters("default", init_lora_weights=True)
    variant = getattr(layer, "lora_variant", {}).get("default")
    if variant is not None and any(p.device.type == "meta" for p in layer.lora_magnitude_vector.parameters()):
        variant.init(layer, adapter_name="default")  # DoRA magnitude from the now filled base weight


def materialize_lora(unit, unit_name: str, seed: int, device: torch.device) -> None:
    """Give the meta LoRA layers inside `unit` real, seeded values on `device` (layer-by-layer loading)."""
    for name, layer in lora_layers(unit, unit_name):
        if is_meta(layer):
            for part in (layer.lora_A, layer.lora_B):
                part.to_empty(device=device)
            init_lora_layer(layer, name, seed)
            to_fp32(layer)


def trainable_state_dict(peft_model, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's saved names (no '.default'), on CPU, contiguous; taken from
    `state_dict` when given (gathered from shards), else from the model."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, state_dict=state_dict)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def check_adapter_state(state: dict[str, torch.Tensor], lora_cfg) -> None:
    """Refuse to write an empty or shapeless adapter (the ZeRO-3 failure mode, peft #2892)."""
    if not state:
        raise RuntimeError("the adapter state is empty; refusing to write it")
    for name, t in state.items():
        if t.numel() == 0:
            raise RuntimeError(f"adapter tensor {name} is empty (shape {tuple(t.shape)}); refusing to write it")
        if "lora_A" in name and t.shape[0] != lora_cfg.r and not lora_cfg.rank_pattern:
            raise RuntimeError(f"adapter tensor {name} has shape {tuple(t.shape)}, expected rank {lora_cfg.r} rows")


def save_adapter(peft_model, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write adapter_config.json + adapter_model.safetensors into out_dir (peft's layout).

    Each file is written to a temporary name and renamed, so a crash leaves the old file or the
    new one, never half of one.
    """
    import os

    from safetensors.torch import save_file

    from lora_tune.checkpoint import fsync_path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora_cfg = peft_model.peft_config["default"]
    state = trainable_state_dict(peft_model) if state is None else state
    check_adapter_state(state, lora_cfg)
    tmp_weights = out / f".adapter_model.safetensors.tmp-{os.getpid()}"
    save_file(state, str(tmp_weights), metadata={"format": "pt"})
    fsync_path(tmp_weights)
    tmp_config_dir = out / f".adapter_config.tmp-{os.getpid()}"
    lora_cfg.save_pretrained(str(tmp_config_dir))
    fsync_path(tmp_config_dir / "adapter_config.json")
    os.replace(tmp_weights, out / "adapter_model.safetensors")
    os.replace(tmp_config_dir / "adapter_config.json", out / "adapter_config.json")
    tmp_config_dir.rmdir()


def load_adapter_weights(peft_model, adapter_dir: str | Path) -> None:
    """Load adapter weights saved by save_adapter back into an identically configured PeftModel."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable or truncated ({e}); delete that checkpoint to resume from an older one") from None
    result = set_peft_model_state_dict(peft_model, state)
    if getattr(result, "unexpected_keys", None):
        raise UserError(f"{path} does not match this LoRA configuration (unexpected: {result.unexpected_keys[:3]})")
