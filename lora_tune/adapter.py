"""Inject LoRA adapters (peft) into the frozen base, and write them out in peft's layout."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.pytorch_utils import Conv1D

from lora_tune.checkpoint import fsync_path, remove_tree, write_safetensors
from lora_tune.errors import UserError

# Routers pick experts; adapting them changes which experts see a token, which LoRA recipes for MoE
# models (Mixtral, Qwen-MoE) leave alone: out of the default, allowed by name.
ROUTERS = ("gate", "router", "shared_expert_gate")


def meta_model(config):
    """The model of `config` on the meta device: every module and shape, no memory, no weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def in_blocks(name: str) -> bool:
    """Inside the repeated transformer blocks: under some ModuleList index (layers.3, h.3, ...)."""
    return any(part.isdigit() for part in name.split("."))


def is_linear(module) -> bool:
    """nn.Linear (bitsandbytes' 8/4-bit layers subclass it) or GPT-2's Conv1D (a transposed linear)."""
    return isinstance(module, (torch.nn.Linear, Conv1D))


def block_path(name: str) -> str:
    """`model.layers.3.mlp.experts` -> `mlp.experts`: the path inside a block."""
    parts = name.split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[digits[0] + 1 :]) if digits else name


@dataclass(frozen=True)
class Targets:
    """What LoRA adapts: linear modules by short name, and fused expert tensors (3-D parameters,
    peft's target_parameters) by their path inside a block."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = ()

    def describe(self, model) -> str:
        counts: dict[str, int] = {}
        for name, _module in model.named_modules():
            short = name.rsplit(".", 1)[-1]
            if short in self.modules and in_blocks(name):
                counts[short] = counts.get(short, 0) + 1
        for name, _ in model.named_parameters():
            if in_blocks(name) and block_path(name) in self.parameters:
                counts[block_path(name)] = counts.get(block_path(name), 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in counts.items())


@dataclass(frozen=True)
class Inventory:
    """What a model offers LoRA, by name: linear layers in the blocks (short names), fused expert
    tensors and non-linear routers (paths inside a block). Taken from the real model or from a
    meta skeleton (the planner), so both resolve --target-modules by the same rules."""

    linears: tuple[str, ...]
    experts: tuple[str, ...]
    routers: tuple[str, ...]

    @classmethod
    def of(cls, model) -> Inventory:
        linears = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if is_linear(m) and in_blocks(n)}
        experts = {block_path(n) for n, p in model.named_parameters() if p.dim() == 3 and in_blocks(n)}
        routers = {block_path(n) for n, m in model.named_modules() if in_blocks(n) and n.rsplit(".", 1)[-1] in ROUTERS and not is_linear(m)}
        return cls(tuple(sorted(linears)), tuple(sorted(experts)), tuple(sorted(routers)))


def resolve_targets(model_or_inventory, cfg) -> Targets:
    """--target-modules checked against the model (a meta skeleton does): each name is a linear
    module (short name), a fused expert tensor (its name, or `experts` for all of them), or a
    router. Default: every linear layer of the transformer blocks (fused qkv_proj / gate_up_proj /
    c_attn kept whole), never lm_head or anything outside the blocks, the MoE routers left out, and
    MoE experts included: per-expert linears by name, fused expert tensors as target parameters."""
    inv = model_or_inventory if isinstance(model_or_inventory, Inventory) else Inventory.of(model_or_inventory)
    if not cfg.target_modules:
        names = [n for n in inv.linears if n not in ROUTERS]
        if not names:
            raise UserError(
                "--target-modules: no linear layers found inside the transformer blocks of this model; pass --target-modules explicitly"
            )
        targets = Targets(tuple(names), inv.experts)
    else:
        modules, parameters = [], []
        for name in cfg.target_modules:
            experts = [e for e in inv.experts if name in ("experts", e.rsplit(".", 1)[-1])]
            routers = [f"{r}.weight" for r in inv.routers if r.rsplit(".", 1)[-1] == name]  # a router as a parameter (peft ParamWrapper)
            if name in inv.linears:
                modules.append(name)
            elif experts or routers:
                parameters += experts + routers
            else:
                choices = " ".join(
                    list(inv.linears) + (["experts"] if inv.experts else []) + sorted({r.rsplit(".", 1)[-1] for r in inv.routers})
                )
                raise UserError(f"--target-modules: {name} is not a linear layer or expert tensor of this model; choose from: {choices}")
        targets = Targets(tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(parameters)))
    if targets.parameters and getattr(cfg, "dropout", 0):
        raise UserError(
            f"--dropout {cfg.dropout}: LoRA on {', '.join(targets.parameters)} (fused expert/router tensors, peft's target_parameters) "
            "works only without dropout; pass --dropout 0, or leave them out with --target-modules " + " ".join(targets.modules)
        )
    if targets.parameters and getattr(cfg, "dora", False):
        raise UserError(
            f"--dora: peft has no DoRA for fused expert/router tensors ({', '.join(targets.parameters)}); leave out --dora or "
            "pass --target-modules " + " ".join(targets.modules)
        )
    return targets


def lora_config(cfg, targets: Targets):
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(targets.modules),
        target_parameters=list(targets.parameters) or None,
        use_rslora=cfg.rslora,
        use_dora=cfg.dora,
        bias="none",
        task_type="CAUSAL_LM",
    )


@dataclass(frozen=True)
class Checkpointing:
    """Which decoder layers recompute their activations in backward: none (`enabled` false), or
    all but the last `kept_layers`, which keep theirs (--gradient-checkpointing auto's choice)."""

    enabled: bool
    kept_layers: int = 0

    @classmethod
    def of(cls, cfg) -> Checkpointing:
        """The setting of the configuration alone (auto, undecided, is every layer)."""
        return cls(cfg.gradient_checkpointing != "off")


def checkpointed_layers(model) -> list:
    """The decoder layers transformers can checkpoint, in order."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_checkpointing(model, checkpointing: Checkpointing, offload: bool) -> None:
    # Non-reentrant checkpointing computes grads for LoRA weights even though the block inputs
    # come from frozen embeddings; input grads are enabled too, so the reentrant path used by
    # some remote-code models doesn't hit "element 0 does not require grad" (transformers #42489).
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        # offload: transformers keeps the checkpointed layer inputs in pinned host memory.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()
    if checkpointing.kept_layers:
        # The layers' own switch (GradientCheckpointingLayer.gradient_checkpointing): the last ones
        # run plainly and keep their activations.
        for layer in checkpointed_layers(model)[-checkpointing.kept_layers :]:
            layer.gradient_checkpointing = False


def add_lora(model, cfg, base_id: str, targets: Targets | None = None, checkpointing: Checkpointing | None = None):
    """Wrap the base with trainable LoRA layers (fp32), checkpointing set up for peft.

    Returns the PeftModel; only LoRA (and DoRA magnitude) parameters require grad. `targets`:
    resolved before loading (from a meta skeleton); else resolved on `model`. `checkpointing`:
    decided for this run (lora_tune.inputs); else the configuration's setting.
    """
    targets = targets or resolve_targets(model, cfg)
    checkpointing = checkpointing or Checkpointing.of(cfg)
    if checkpointing.enabled:
        enable_checkpointing(model, checkpointing, getattr(cfg, "activation_offload", False))
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
    state = get_peft_model_state_dict(peft_model, state_dict=state_dict)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def check_adapter_state(state: dict[str, torch.Tensor], lora_cfg) -> None:
    """Refuse to write an empty or shapeless adapter (the ZeRO-3 failure mode, peft #2892)."""
    if not state:
        raise RuntimeError("the adapter state is empty; refusing to write it")
    for name, t in state.items():
        if t.numel() == 0:
            raise RuntimeError(f"adapter tensor {name} is empty (shape {tuple(t.shape)}); refusing to write it")
        # r rows; fused expert tensors (target_parameters) stack one rank-r factor per expert.
        rows_ok = t.shape[0] % lora_cfg.r == 0 if lora_cfg.target_parameters else t.shape[0] == lora_cfg.r
        if "lora_A" in name and not rows_ok and not lora_cfg.rank_pattern:
            raise RuntimeError(f"adapter tensor {name} has shape {tuple(t.shape)}, expected rank {lora_cfg.r} rows")


def save_adapter(peft_model, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write adapter_config.json + adapter_model.safetensors into out_dir (peft's layout).

    Each file is written to a temporary name and renamed, so a crash leaves the old file or the
    new one, never half of one, and a failed write leaves no temporary file.
    """

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora_cfg = peft_model.peft_config["default"]
    state = trainable_state_dict(peft_model) if state is None else state
    check_adapter_state(state, lora_cfg)
    tmp_weights = out / f".adapter_model.safetensors.tmp-{os.getpid()}"
    tmp_config_dir = out / f".adapter_config.tmp-{os.getpid()}"
    try:
        write_safetensors(tmp_weights, state, metadata={"format": "pt"})
        fsync_path(tmp_weights)
        lora_cfg.save_pretrained(str(tmp_config_dir))
        fsync_path(tmp_config_dir / "adapter_config.json")
        os.replace(tmp_weights, out / "adapter_model.safetensors")
        os.replace(tmp_config_dir / "adapter_config.json", out / "adapter_config.json")
    finally:  # a failed write (full disk) leaves no temporary file behind; a kill's are removed on --resume
        remove_tree(tmp_weights)
        remove_tree(tmp_config_dir)


def load_adapter_weights(peft_model, adapter_dir: str | Path) -> None:
    """Load adapter weights saved by save_adapter back into an identically configured PeftModel."""
    path = Path(adapter_dir) / "adapter_model.safetensors"
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable or truncated ({e}); delete that checkpoint to resume from an older one") from None
    result = set_peft_model_state_dict(peft_model, state)
    if getattr(result, "unexpected_keys", None):
        raise UserError(f"{path} does not match this LoRA configuration (unexpected: {result.unexpected_keys[:3]})")
