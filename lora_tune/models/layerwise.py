"""Load a base one decoder layer at a time, so a sharding backend partitions each layer before the
next one is read: no rank (and no host) ever holds more than its partition plus about one layer.

The model is built on the meta device (no memory), the adapter is injected there too, and then
each decoder layer is filled from the safetensors shards (memory-mapped, read tensor by tensor),
quantized on the device when the base is 8-bit or 4-bit, its LoRA weights initialised, and handed
to `partition(layer)`; the rest of the model (embeddings, final norm, head) follows last.

Checkpoints that transformers renames or fuses on load (per-expert MoE tensors fused into one,
an image-text wrapper's `language_model.model.*`) are converted layer by layer with transformers'
own conversion mapping (`checkpoint_layout`), exactly as from_pretrained converts them; a
checkpoint that lacks a tensor the model needs raises `NotStreamable`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import bitsandbytes as bnb
import torch
from transformers import AutoConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from lora_tune.errors import UserError
from lora_tune.models import shards
from lora_tune.models.checkpoint_layout import CheckpointLayout
from lora_tune.models.int8_sharded import ShardableLinear8bit
from lora_tune.models.loading import WEIGHT_DTYPE, attention_implementation, load_config
from lora_tune.models.structure import auto_class, block_modules, decoder_body
from lora_tune.models.targets import base_name

log = logging.getLogger("lora_tune")


class NotStreamable(Exception):
    """This checkpoint can't be loaded layer by layer (the message says why)."""


class CheckpointReader:
    """Tensor by tensor reads from a model folder's safetensors shards, with plain positioned reads
    (no memory map): a file page touched through a map stays in this process's resident memory
    until the map closes, which would hold the whole checkpoint by the end of loading."""

    def __init__(self, folder: str):
        if shards.shard_files(Path(folder)) is None:
            raise NotStreamable(f"{folder} has no safetensors weights on this machine")
        self.entries = shards.read_headers(Path(folder))
        unreadable = next((key for key, e in self.entries.items() if e.dtype not in shards.DTYPES), None)
        if unreadable:
            raise NotStreamable(f"{unreadable} is stored as {self.entries[unreadable].dtype}, which layer-by-layer loading does not read")

        self.layout: CheckpointLayout | None = None  # set once the model's skeleton exists

    def __contains__(self, key: str) -> bool:
        """The model tensor `key` is in the checkpoint (under its own name or converted)."""
        return key in self.layout.groups

    def model_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The model tensors `keys`, read from the disk tensors they are built from and converted
        as from_pretrained converts them (a fused expert tensor: all its experts' disk tensors)."""
        return self.layout.disk_to_model({d: self.get(d) for k in keys for d in self.layout.groups[k]})

    def get(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        buffer = bytearray(entry.nbytes)
        fd = os.open(entry.file, os.O_RDONLY)
        try:
            view, done = memoryview(buffer), 0
            while done < entry.nbytes:
                n = os.preadv(fd, [view[done:]], entry.offset + done)
                if n == 0:
                    raise OSError(f"{entry.file} ends before {key} does (truncated file)")
                done += n
        finally:
            os.close(fd)
        dtype = shards.DTYPES[entry.dtype]
        if not entry.nbytes:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry.shape)


def decoder_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each repeated block of the language model: the classes transformers never
    splits across devices, inside the decoder body (an image-text wrapper's vision blocks are
    loaded with the rest of the model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    classes = set(getattr(base, "_no_split_modules", None) or ())
    at = next(name for name, m in model.named_modules() if m is base)  # under a peft model / the loss module
    layers = [(f"{at}.{name}" if at else name, m) for name, m in block_modules(base) if type(m).__name__ in classes]
    if not layers:
        raise NotStreamable(f"{type(decoder_body(base)).__name__} declares no decoder-layer class (_no_split_modules)")
    return layers


def build_skeleton(
    base_path: str,
    precision: str,
    trust_remote_code: bool,
    quant_storage: torch.dtype | None = None,
    shardable_int8: bool = False,
    attn_implementation: str = "sdpa",
):
    """(model on the meta device, reader of its checkpoint). The model has bitsandbytes layers in place of the block linears when
    quantized; it holds no memory. Raises NotStreamable when the checkpoint's names don't match."""
    config = AutoConfig.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    reader = CheckpointReader(base_path)
    with torch.device("meta"):
        model = auto_class(config).from_config(
            config, dtype=WEIGHT_DTYPE[precision], trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )
    model.config.use_cache = False
    reader.layout = CheckpointLayout(model, reader.entries)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [k for k in model.state_dict() if k not in reader and k not in tied]
    if missing:
        raise NotStreamable(f"the checkpoint has no tensor for {missing[0]} (nor any it is converted from)")
    if precision in ("8bit", "4bit"):
        _quantized_linears(model, precision, quant_storage, shardable_int8)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, reader


def streamed_skeleton(base_path: str, cfg, device: torch.device, refused: str, fix: str):
    """The skeleton and reader a sharding backend streams (4-bit as bf16 words, 8-bit as the
    shardable int8 layer); a checkpoint that can't be streamed is one error line: `refused` names
    the setup, `fix` what to use instead."""
    try:
        attention = attention_implementation(cfg, load_config(base_path, cfg.trust_remote_code), device)
        return build_skeleton(
            base_path,
            cfg.precision,
            cfg.trust_remote_code,
            quant_storage=torch.bfloat16,
            shardable_int8=True,
            attn_implementation=attention,
        )
    except NotStreamable as e:
        raise UserError(f"{refused}: {base_path} can't be loaded layer by layer ({e}); {fix}") from None


def _quantized_linears(model, precision: str, quant_storage: torch.dtype | None, shardable_int8: bool) -> None:
    """Swap every nn.Linear of the decoder layers for its bitsandbytes twin (still on meta); the
    head and embeddings stay in the compute dtype, as transformers' bitsandbytes integration keeps them."""
    for _, layer in decoder_layers(model):
        for name, child in list(layer.named_modules()):
            if isinstance(child, Conv1D):
                # transformers transposes these into bitsandbytes layers while loading; streamed
                # here they would stay unquantized, so they are not streamed at all.
                raise NotStreamable(
                    f"{type(layer).__name__} has GPT-2-style Conv1D layers, which are quantized only by transformers' whole-model loading"
                )
            if type(child) is not torch.nn.Linear:
                continue
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            with torch.device("meta"):
                if precision == "4bit":
                    new = bnb.nn.Linear4bit(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        compute_dtype=torch.bfloat16,
                        compress_statistics=True,
                        quant_type="nf4",
                        quant_storage=quant_storage or torch.uint8,
                    )
                elif shardable_int8:
                    new = ShardableLinear8bit(child.in_features, child.out_features, bias=child.bias is not None)
                else:
                    new = bnb.nn.Linear8bitLt(
                        child.in_features, child.out_features, bias=child.bias is not None, has_fp16_weights=False, threshold=6.0
                    )
            setattr(parent, name.rsplit(".", 1)[-1], new)


def _set_weight(module, name: str, value: torch.Tensor, device: torch.device) -> None:
    """Put a checkpoint tensor into the module, quantizing it on the device where the module is a
    bitsandbytes layer (the same calls transformers' integration makes)."""
    old = getattr(module, name)
    if isinstance(module, bnb.nn.Linear4bit) and name == "weight":
        new = bnb.nn.Params4bit(
            value,
            requires_grad=False,
            blocksize=old.blocksize,
            compress_statistics=old.compress_statistics,
            quant_type=old.quant_type,
            quant_storage=old.quant_storage,
            module=module,
        ).to(device)
    elif isinstance(module, bnb.nn.Linear8bitLt) and name == "weight":
        module.weight = bnb.nn.Int8Params(value, requires_grad=False, has_fp16_weights=False).to(device)
        if hasattr(module, "take_quantized"):
            module.take_quantized()
        return
    elif isinstance(old, torch.nn.Parameter):
        new = torch.nn.Parameter(value.to(device), requires_grad=False)
    else:
        module.register_buffer(name, value.to(device), persistent=name not in module._non_persistent_buffers_set)
        return
    setattr(module, name, new)


def fill(unit: torch.nn.Module, unit_name: str, reader: CheckpointReader, config, device: torch.device, dtype: torch.dtype) -> None:
    """Every meta tensor of `unit` that the checkpoint holds, read and placed on `device`;
    non-persistent buffers (rotary frequencies) recomputed by rebuilding their module there."""
    prefix = f"{unit_name}." if unit_name else ""
    wanted = []
    for module_name, module in unit.named_modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = base_name(f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}")
            if tensor.device.type == "meta" and key in reader:
                wanted.append((module, name, key))
    values = reader.model_tensors([key for _, _, key in wanted])
    for module, name, key in wanted:
        value = values.pop(key)
        _set_weight(module, name, value.to(dtype) if value.is_floating_point() else value, device)
    # A module's own config is its sub-model's (an image-text wrapper's text model has the text config).
    configs = {name: m.config for name, m in unit.named_modules() if isinstance(m, PreTrainedModel)}
    for module_name, module in unit.named_modules():
        meta_buffers = [n for n, b in module.named_buffers(recurse=False) if b.device.type == "meta"]
        if meta_buffers:
            owner = max((n for n in configs if not n or module_name == n or module_name.startswith(n + ".")), key=len, default=None)
            try:
                with torch.device(device):
                    fresh = type(module)(config=configs[owner] if owner is not None else config)
            except TypeError:
                # Not built from a config (Gemma 3's scaled embedding): its sub-model's own
                # initialisation sets the buffers, as from_pretrained does for buffers the files don't
                # hold; the tensors just read are marked initialised, so it leaves them alone.
                init_buffers(module, meta_buffers, dict(unit.named_modules()).get(owner, unit), device)
                continue
            for n in meta_buffers:
                module.register_buffer(n, getattr(fresh, n), persistent=n not in module._non_persistent_buffers_set)


def init_buffers(module: torch.nn.Module, names: list[str], owner: torch.nn.Module, device: torch.device) -> None:
    """`module`'s meta buffers `names` set by `owner`'s (a PreTrainedModel's) `_init_weights`."""
    if not isinstance(owner, PreTrainedModel):
        raise NotStreamable(f"can't rebuild the buffers of {type(module).__name__} (no model initialises them)")
    for tensor in module.parameters(recurse=False):
        tensor._is_hf_initialized = True
    for n in names:
        persistent = n not in module._non_persistent_buffers_set
        module.register_buffer(n, torch.empty_like(getattr(module, n), device=device), persistent=persistent)
    owner._init_weights(module)


def load_layer_by_layer(
    skeleton,
    reader: CheckpointReader,
    device: torch.device,
    precision: str,
    init_adapter: Callable[[torch.nn.Module, str], None],
    partition: Callable[[torch.nn.Module], None],
    partition_root: Callable[[torch.nn.Module], None],
) -> None:
    """Fill the (adapter-injected) skeleton: each decoder layer, then its adapter weights
    (`init_adapter`), then `partition(layer)`; the remaining modules last, then `partition_root`."""
    dtype = WEIGHT_DTYPE[precision]
    base = skeleton.get_base_model() if hasattr(skeleton, "get_base_model") else skeleton
    text_config = decoder_body(base).config
    for name, layer in decoder_layers(skeleton):
        fill(layer, name, reader, text_config, device, dtype)
        init_adapter(layer, name)
        partition(layer)
    fill(skeleton, "", reader, base.config, device, dtype)
    init_adapter(skeleton, "")
    if getattr(base.config, "tie_word_embeddings", False):
        base.tie_weights()
    leftover = [n for n, p in list(skeleton.named_parameters()) + list(skeleton.named_buffers()) if p.device.type == "meta"]
    if leftover:
        raise RuntimeError(f"layer-by-layer loading left {len(leftover)} tensors unfilled, e.g. {leftover[0]}")
    partition_root(skeleton)
