"""An image-text model's vision tower and projector in the plan: their weights as loaded, the pixels of
a micro-batch's images, and the tower's forward.

* Weights: everything outside the language model and its head (vision tower, projector; an audio
  encoder too), read off the meta skeleton, counted once and shown as `vision_tower`. Under 8/4-bit,
  bitsandbytes quantizes their linear layers as it does the language model's (Gemma 3's SigLIP,
  LLaVA's CLIP and projector, Qwen2-VL's tower: asked of transformers' own replacement on the
  skeleton, and checked against a real 4-bit and 8-bit load in the tests); the rest stays bf16.
* Images: one per sequence of a micro-batch (the plan doesn't see the data; a text-only run on an
  image-text base needs less by the `images` line). The tower sees, per image, (image_size /
  patch)^2 patches for a fixed-size family (Gemma 3, LLaVA: every image is resized to the vision
  config's image_size), else at most --max-pixels / patch^2 (Qwen2-VL, Pixtral, PaddleOCR-VL:
  dynamic resolution; the processor may scale an image further down). The language model sees
  `mm_tokens_per_image` of them (Gemma 3) or the patches merged spatial_merge_size^2 to one: they
  count in --max-seq-len, so the language model's terms already hold them. Families that cut an
  image into several tiles (Llama 4, Idefics 3, InternVL; Gemma 3's pan-and-scan) are planned at
  one tile per image.
* The pixel values (fp32, as the processor gives them) live through the step.
* The tower's forward, frozen (the default): nothing in it needs a gradient, so autograd keeps
  nothing of it (with gradient checkpointing too: the adapter requires grads from the language
  model's embeddings only, tested); its working memory is one block's at a time, before the language model's layers run, and it
  counts where it exceeds their activations and logits. Per patch, measured on a CPU
  (tests/planner/test_vision.py) for SigLIP, CLIP, Qwen2-VL's and Pixtral's towers:
    the patch's pixel values in the compute dtype        C p^2 t       (t: temporal_patch_size)
    residual stream, norm, attention or block output     4 w           (rotary towers: 10 w: their
                                                                        q, k and rotated copies)
    MLP: input projection and activation                 2 i           (one-op activations: gelu,
                                                                        gelu_pytorch_tanh, relu, silu)
                                                         3 i           (several ops: quick_gelu, ...;
                                                                        gated MLPs one i more)
  in the compute dtype, where w is the tower's width and i its MLP's. Under eager attention the
  peak may be at the scores instead: the w-wide part with each image's [heads x patches x patches]
  scores (compute dtype, the fp32 softmax, and its fp32 input under half precision); other
  attentions hold none. Pixtral attends over a micro-batch's images as
  one sequence: with several images per micro-batch its masked attention is larger than planned.
  Measured peaks lie at most 10% below the plan (SigLIP, CLIP, Pixtral; eager within 5% either
  way), 25% for Qwen2-VL in bf16 and 55% in fp32 (its rotary copies are made under half precision
  only): conservative.
* --train-vision: LoRA on the tower's and projector's linear layers named by the targets
  (--target-modules, or by default every one of them, as in the language model), and the tower's
  activations kept for backward (every block's working set, planned without checkpointing) on top
  of the language model's.
"""

from __future__ import annotations

from dataclasses import replace

import bitsandbytes as bnb
import torch
from transformers.integrations.bitsandbytes import replace_with_bnb_linear
from transformers.quantizers.auto import AutoHfQuantizer

from lora_tune.engines.spec import BackendSpec, ModelStates
from lora_tune.models.loading import quantization_config
from lora_tune.models.structure import is_image_text, linear_name, vision_parts
from lora_tune.models.targets import is_plain_linear
from lora_tune.planner.records import Setup, VisionTower

ONE_OP_ACTIVATIONS = {"gelu", "gelu_pytorch_tanh", "relu", "silu", "swish"}  # one PyTorch op: no temporary
FP32 = 4


def _size(value) -> int | None:
    """A size the config gives as an int or a (height, width) pair: its first side."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return int(value) if isinstance(value, (int, float)) and value else None


def _quantized(skeleton, roots: list[torch.nn.Module]) -> tuple[tuple[int, int], ...]:
    """The tower's linear layers bitsandbytes replaces, by transformers' own replacement run on the
    skeleton (it skips what it skips: heads, modules kept in fp32, nn.MultiheadAttention's output)."""
    config = quantization_config("4bit")
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    skip = quantizer.get_modules_to_not_convert(skeleton, None, getattr(skeleton, "_keep_in_fp32_modules", None))
    with torch.device("meta"):
        replace_with_bnb_linear(skeleton, modules_to_not_convert=skip, quantization_config=config)
    return tuple(
        (m.in_features, m.out_features) for root in roots for m in root.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    )


def read_tower(config, skeleton) -> VisionTower | None:
    """The vision tower of an image-text model's meta skeleton (None for a text model). Replaces the
    skeleton's linear layers with bitsandbytes' (the skeleton is not for anything else afterwards)."""
    if not is_image_text(config):
        return None
    roots = [module for _, module in vision_parts(skeleton)]
    params = {id(p): p.numel() for root in roots for p in root.parameters()}
    if not params:
        return None  # the image encoder sits inside the language model's body (GIT): counted with it
    linears = tuple(
        (linear_name(n), m.in_features, m.out_features) for root in roots for n, m in root.named_modules() if is_plain_linear(m)
    )
    blocks = max((m for root in roots for m in root.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=())
    block = [m for m in blocks[0].modules() if is_plain_linear(m)] if len(blocks) else []
    width = block[0].in_features if block else 0
    intermediate = max((m.in_features for m in block if m.out_features == width and m.in_features != width), default=4 * width)
    vision = getattr(config, "vision_config", None)

    def get(*keys, source=vision):
        return next((getattr(source, k) for k in keys if getattr(source, k, None) is not None), None)

    merge = _size(get("spatial_merge_size")) or _size(get("spatial_merge_size", source=config))
    rotary = any(name.rsplit(".", 1)[-1] == "inv_freq" for root in roots for name, _ in root.named_buffers())
    return VisionTower(
        params=sum(params.values()),
        quantized=_quantized(skeleton, roots),
        linears=linears,
        layers=len(blocks),
        width=width,
        intermediate=intermediate,
        heads=_size(get("num_attention_heads", "num_heads")) or 1,
        gated=sum(m.in_features == width and m.out_features == intermediate for m in block) >= 2,
        one_op_activation=get("hidden_act", "hidden_activation") in ONE_OP_ACTIVATIONS,
        rotary=rotary,
        patch=_size(get("patch_size")) or 14,
        channels=_size(get("num_channels", "in_channels", "in_chans")) or 3,
        temporal=_size(get("temporal_patch_size")) or 1,
        image_size=None if merge else _size(get("image_size")),
        merge=merge or 1,
        tokens_per_image=_size(get("mm_tokens_per_image", source=config)),
    )


# --- per image ---------------------------------------------------------------------------------------
def patches(tower: VisionTower, max_pixels: int) -> int:
    """Patches the tower sees per image: the fixed size's, or at most --max-pixels' worth."""
    if tower.image_size:
        return (tower.image_size // tower.patch) ** 2
    return max(1, max_pixels // tower.patch**2)


def image_tokens(tower: VisionTower, max_pixels: int) -> int:
    """Language-model tokens per image (of a row's --max-seq-len)."""
    return tower.tokens_per_image or max(1, patches(tower, max_pixels) // tower.merge**2)


def images(setup: Setup) -> int:
    """Images in a forward pass: one per sequence (a unit's sequences each carry it)."""
    return setup.tokens // setup.row_tokens * setup.sequences_per_unit


def per_patch(tower: VisionTower, element: int) -> tuple[int, int]:
    """(the patch's pixels and its w-wide tensors, its MLP's i-wide ones) in a block at its peak, in bytes."""
    mlp = 2 + (not tower.one_op_activation) + tower.gated
    residual = 10 if tower.rotary else 4
    return element * (tower.channels * tower.patch**2 * tower.temporal + residual * tower.width), element * mlp * tower.intermediate


def scores_bytes(tower: VisionTower, setup: Setup, element: int) -> int:
    """Eager attention's scores of one block over every image of the pass (none for other attentions)."""
    if setup.attention.removeprefix("ulysses_") != "eager":
        return 0
    per_score = element + FP32 + (FP32 if element < FP32 else 0)
    return images(setup) * tower.heads * patches(tower, setup.max_pixels) ** 2 * per_score


def forward_bytes(tower: VisionTower, setup: Setup, element: int) -> int:
    """The tower's working memory in its forward over a pass's images: a block's at its MLP, or at
    eager attention's scores (which exist before the MLP runs)."""
    narrow, mlp = per_patch(tower, element)
    patches_in_pass = images(setup) * patches(tower, setup.max_pixels)
    return max(patches_in_pass * (narrow + mlp), patches_in_pass * narrow + scores_bytes(tower, setup, element))


def pixel_bytes(tower: VisionTower, setup: Setup) -> int:
    """The pass's pixel values in fp32, as the processor gives them."""
    return images(setup) * patches(tower, setup.max_pixels) * tower.channels * tower.patch**2 * tower.temporal * FP32


def images_bytes(tower: VisionTower, setup: Setup, element: int, language_peak: int) -> int:
    """The `images` line: the pixel values, and the tower's forward where it exceeds the language
    model's peak (frozen), or on top of it with every block's activations kept (--train-vision)."""
    forward = forward_bytes(tower, setup, element)
    if setup.train_vision:
        return pixel_bytes(tower, setup) + tower.layers * forward
    return pixel_bytes(tower, setup) + max(0, forward - language_peak)


# --- model states ------------------------------------------------------------------------------------
def lora_tensors(tower: VisionTower | None, setup: Setup, names: set[str]) -> list[int]:
    """--train-vision: A (r x in) and B (out x r) of each of the tower's linear layers named `names`."""
    if tower is None or not setup.train_vision:
        return []
    return [size for name, n_in, n_out in tower.linears if name in names for size in (setup.rank * n_in, n_out * setup.rank)]


def placed(spec: BackendSpec, states: ModelStates, setup: Setup, tower_bytes: int) -> tuple[int, int]:
    """(per device, offloaded to the host per device) of the tower's weights, placed by the backend as
    part of the whole model it loads: the difference the tower makes to the placed weights."""
    alone = spec.place(states, setup.zero, setup.offload, setup.world)
    whole = spec.place(replace(states, weights=states.weights + tower_bytes), setup.zero, setup.offload, setup.world)
    return whole.device.weights - alone.device.weights, whole.host_weights - alone.host_weights


def note(tower: VisionTower | None, setup: Setup, element: int) -> str | None:
    """What the plan assumed about images, in one line."""
    if tower is None:
        return None
    per_image = patches(tower, setup.max_pixels)
    size = f"fixed {tower.image_size} px images" if tower.image_size else f"dynamic resolution, at most --max-pixels {setup.max_pixels:,}"
    tokens = image_tokens(tower, setup.max_pixels)
    fit = f"; an image alone is longer than --max-seq-len {setup.max_seq_len:,}" if tokens > setup.max_seq_len else ""
    mode = (
        "trained (--train-vision): its activations are kept for backward, every block's"
        if setup.train_vision
        else "frozen: its forward is transient, before the language model's layers, and counts where it exceeds their activations + logits"
    )
    peak = forward_bytes(tower, setup, element) / 2**30
    return (
        f"note: vision tower ({tower.params / 1e6:,.1f}M parameters, {tower.layers} blocks): one image per sequence assumed, "
        f"{per_image:,} patches per image ({size}), {tokens:,} image tokens of each row's {setup.max_seq_len:,}{fit}; "
        f"{mode} (forward {peak:.2f} GiB over {images(setup)} image(s); `images` holds it with the pixel values)"
    )
