"""A model's parts, found by structure and transformers' own mappings rather than naming conventions.

* `auto_class(config)` / `model_class(config)`: the class a checkpoint is loaded through. Image-text
  checkpoints (Gemma 3, Mistral 3, Qwen-VL, Llama 4, ...) are saved from their image-text-to-text
  class even when trained on text only: that class's names and conversion mapping match their files,
  and some of them (Mistral 3) have no causal-LM class at all.
* `decoder_body(model)`: the module that turns input_ids into the hidden states the output head reads,
  i.e. the innermost PreTrainedModel that owns the input embeddings. `getattr(model,
  model.base_model_prefix)` misses it where the prefix names a checkpoint layout rather than an
  attribute (Llama4ForCausalLM: prefix "language_model", body at `.model`), and `get_decoder()` stops
  at the model itself there.
* `body_path(model)`: where that body sits; everything outside it and the head (vision tower,
  projector, audio encoder) is not the language model: never adapted, but counted by a plan.
"""

from __future__ import annotations

import re

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)


def is_image_text(config) -> bool:
    """transformers maps this model type to an image-text-to-text class (its checkpoints are saved from it)."""
    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def auto_class(config):
    """The auto class that loads this config's checkpoints (remote code included: causal LM)."""
    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def model_class(config):
    """The transformers class of a config's checkpoints (None for remote code or unknown models)."""
    mapping = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if is_image_text(config) else MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        return mapping[type(config)]
    except KeyError:
        return None


def meta_model(config):
    """The model of `config` on the meta device: every module and shape, no memory, no weights."""
    with torch.device("meta"):
        return auto_class(config).from_config(config)


def text_ids(model, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random token ids a text-only forward accepts: any id of the vocabulary but the special ids
    the config names (an image-text model's image/video/audio placeholders want pixel values)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    special = set()
    for config in [model.config, *(getattr(model.config, k, None) for k in (getattr(model.config, "sub_configs", None) or {}))]:
        for key, value in (config.to_dict() if config is not None and hasattr(config, "to_dict") else {}).items():
            if (
                key.endswith(("_token_id", "_token_index"))
                and isinstance(value, int)
                and key not in ("bos_token_id", "eos_token_id", "pad_token_id")
            ):
                special.add(value)
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    return allowed[torch.randint(0, len(allowed), shape, generator=torch.Generator().manual_seed(seed))]


def decoder_body(model):
    """The innermost PreTrainedModel containing the input embeddings (and so the decoder layers)."""
    embed = model.get_input_embeddings()
    best, depth = None, -1
    for name, module in model.named_modules():
        if module is embed or not isinstance(module, PreTrainedModel):
            continue
        here = name.count(".") + 1 if name else 0
        if here > depth and any(m is embed for m in module.modules()):
            best, depth = module, here
    if best is None:
        raise ValueError(f"{type(model).__name__}: no sub-model owns the input embeddings")
    return best


def multimodal_body(model):
    """The image-text model's body below its head: the sub-model that runs the vision tower and puts
    its features in place of the image tokens (`get_image_features`), then the decoder. None for a
    wrapper without one (Llama 4 keeps them apart)."""
    embed = model.get_input_embeddings()
    for _, module in model.named_children():
        if isinstance(module, PreTrainedModel) and hasattr(module, "get_image_features") and any(m is embed for m in module.modules()):
            return module
    return None


def body_path(model) -> str:
    """The module path of `decoder_body(model)` ('' when the model is its own body)."""
    body = decoder_body(model)
    return next(name for name, m in model.named_modules() if m is body)


def vision_parts(model) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of the outermost modules whose parameters all lie outside the language model
    (the decoder body and the output head): an image-text model's vision tower and projector (an
    audio encoder too). None in a text model, nor where the encoder sits inside the body (GIT)."""
    head = model.get_output_embeddings()
    inside = {id(p) for module in (decoder_body(model), head) if module is not None for p in module.parameters()}
    parts: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{p}.") for p, _ in parts):
            continue
        params = list(module.parameters())
        if params and all(id(p) not in inside for p in params):
            parts.append((name, module))
    return parts


def block_modules(model):
    """(full name, module) of every module inside the decoder body's repeated blocks: the elements
    of its ModuleLists (layers, h, blocks, ...) and everything under them, each module once. Other
    sub-models inside the body (GIT's image encoder) are not the language model's blocks."""
    seen = set()

    def walk(module, name, in_block):
        for child_name, child in module.named_children():
            if isinstance(child, PreTrainedModel) or id(child) in seen:
                continue
            full = f"{name}.{child_name}" if name else child_name
            inside = in_block or isinstance(module, torch.nn.ModuleList)
            if inside:
                seen.add(id(child))
                yield full, child
            yield from walk(child, full, inside)

    yield from walk(decoder_body(model), body_path(model), False)


def linear_name(name: str) -> str:
    """How a linear layer is named as a LoRA target: its last path component, with its parent's when
    that is an index (`mlp.fc.0`: `fc.0`, an element of a Sequential)."""
    parts = name.split(".")
    keep = 1
    while keep < len(parts) and parts[-keep].isdigit():
        keep += 1
    return ".".join(parts[-keep:])


def anchored_pattern(prefix: str, short_names, vision: tuple[str, ...] = ()) -> str:
    """A peft target pattern (re.fullmatch on module names) for the modules named `short_names`
    inside the blocks under `prefix`, and, with `vision` paths, anywhere under them too
    (--train-vision); nowhere else."""
    names = "|".join(re.escape(n) for n in sorted(short_names))
    pattern = rf"{re.escape(prefix)}\.(?:.+\.)?\d+\.(?:.+\.)?(?:{names})"
    if not vision or not short_names:
        return pattern
    roots = "|".join(re.escape(v) for v in vision)
    return rf"(?:{pattern})|(?:(?:{roots})\.(?:.+\.)?(?:{names}))"


def recurrent_layers(config) -> int:
    """How many layers carry a recurrent or convolution state across tokens (linear attention,
    Mamba/SSM, short convolutions), by transformers' own cache layer classes for them."""
    try:
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, KeyError, TypeError, ValueError):  # no per-layer description: a plain decoder
        return 0
    kinds = [DYNAMIC_LAYER_TYPE_MAPPING.get(t) for t in layer_types]
    return sum(isinstance(k, type) and issubclass(k, LinearAttentionCacheLayerMixin) for k in kinds)
