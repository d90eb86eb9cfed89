"""Image-text models in the plan (lora_tune.planner.vision): the vision tower's weights counted once,
as bitsandbytes loads them, on their own line; the images' line for image-text models only, growing
with --max-pixels for a dynamic-resolution family and not for a fixed-size one; the tower's
forward against its measured peak."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

from lora_tune.config import TrainConfig
from lora_tune.models.adapter import Checkpointing, add_lora
from lora_tune.models.loading import load_base_model
from lora_tune.models.structure import body_path, meta_model
from lora_tune.models.tiny.configs import shrink_config
from lora_tune.models.tiny.vision import build_tiny_image_text_model
from lora_tune.planner import memory as plan
from lora_tune.planner import render, vision
from lora_tune.planner.architecture import Architecture, load_architecture
from lora_tune.planner.measured import cpu_tensor_peak
from lora_tune.planner.run_plan import memory_plan

from helpers import run_cli

IMAGE_TEXT = ["gemma3", "llava", "qwen2_vl", "mistral3"]


@pytest.fixture(scope="module")
def real_size():
    """The transformers default (real-size) config of each family, planned."""
    return {t: Architecture.from_config(CONFIG_MAPPING[t]().to_dict()) for t in IMAGE_TEXT}


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    return {t: build_tiny_image_text_model(t, tmp_path_factory.mktemp(f"tiny-{t}")) for t in ("gemma3", "llava")}


def test_vision_lines_for_image_text_models_only(real_size, capsys):
    for model_type, arch in real_size.items():
        per_device = plan.estimate(arch, plan.Setup()).per_device
        assert {"vision_tower_bytes", "images_bytes"} <= set(per_device), model_type
        assert per_device["total_bytes"] == sum(v for k, v in per_device.items() if k != "total_bytes")
    text = plan.estimate(load_architecture("llama-8b"), plan.Setup()).per_device
    assert not {"vision_tower_bytes", "images_bytes"} & set(text)
    code, out, _ = run_cli(["plan", "--base", "gemma3-27b", "--precision", "4bit"], capsys)
    lines = out.splitlines()
    assert code == 0 and any(line.split()[0] == "vision_tower" for line in lines if line.strip())
    note = next(line for line in lines if line.startswith("note: vision tower"))
    assert "one image per sequence assumed" in note and "4,096 patches per image (fixed 896 px images)" in note
    assert "256 image tokens of each row's 2,048" in note and "frozen" in note
    code, out, _ = run_cli(["plan", "--base", "llama-8b"], capsys)
    assert code == 0 and "vision" not in out


@pytest.mark.parametrize("model_type", IMAGE_TEXT)
def test_vision_weights_are_counted_once(model_type, real_size):
    """In bf16 every parameter is 2 bytes: the language model's line and the tower's add up to the
    whole model, the tower's being exactly what lies outside the language model and its head."""
    arch = real_size[model_type]
    skeleton = meta_model(CONFIG_MAPPING[model_type]())
    language = body_path(skeleton)
    head = {id(p) for p in skeleton.get_output_embeddings().parameters()}
    outside = {id(p): p.numel() for n, p in skeleton.named_parameters() if not n.startswith(f"{language}.") and id(p) not in head}
    assert arch.vision.params == sum(outside.values()) > 0
    per_device = plan.estimate(arch, plan.Setup(precision="bf16")).per_device
    assert per_device["vision_tower_bytes"] == 2 * arch.vision.params
    assert per_device["weights_bytes"] + per_device["vision_tower_bytes"] == 2 * arch.total


def _loaded_bytes(model) -> tuple[int, int]:
    """(language model and head, the rest) of a loaded model's weights, quantization states included."""

    def nbytes(t):
        return t.numel() * t.element_size()

    language = body_path(model)
    head = {id(p) for p in model.get_output_embeddings().parameters()}
    inside = outside = 0
    for name, p in model.named_parameters():
        size = nbytes(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:  # NF4: absmax, code, and the double-quantisation state
            size += nbytes(qs.absmax) + nbytes(qs.code) + nbytes(qs.offset) + nbytes(qs.state2.absmax) + nbytes(qs.state2.code)
        if getattr(p, "SCB", None) is not None:  # LLM.int8's row scales, on the weight until a first forward
            size += nbytes(p.SCB)
        if name.startswith(f"{language}.") or id(p) in head:
            inside += size
        else:
            outside += size
    return inside, outside


@pytest.mark.parametrize("precision", ["bf16", "8bit", "4bit"])
@pytest.mark.parametrize("model_type", ["gemma3", "llava"])
def test_the_tower_is_planned_as_bitsandbytes_loads_it(model_type, precision, tiny_checkpoints):
    """Byte-exact against a real load on this CPU: bitsandbytes quantizes the tower's linear layers
    (and LLaVA's projector) like the language model's, and leaves nn.MultiheadAttention's output
    projection (SigLIP's pooling head) and Gemma 3's projector matrix in bf16."""
    path = tiny_checkpoints[model_type]
    model = load_base_model(str(path), precision, torch.device("cpu"))
    if precision != "bf16":
        assert any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.model.vision_tower.modules())
    language, tower = _loaded_bytes(model)
    per_device = plan.estimate(load_architecture(str(path)), plan.Setup(precision=precision)).per_device
    assert (per_device["weights_bytes"], per_device["vision_tower_bytes"]) == (language, tower)


def test_sharding_backends_place_the_tower_with_the_model(real_size):
    arch = real_size["gemma3"]
    whole = plan.estimate(arch, plan.Setup(precision="bf16")).per_device["vision_tower_bytes"]
    sharded = plan.estimate(arch, plan.Setup(precision="bf16", backend="fsdp", gpus=4))
    assert sharded.per_device["vision_tower_bytes"] == pytest.approx(whole / 4, abs=4)
    offloaded = plan.estimate(arch, plan.Setup(precision="bf16", backend="fsdp", gpus=4, offload="cpu"))
    weights = plan.vision_weight_bytes(arch, "bf16") + plan.base_weight_bytes(arch, "bf16")[0]
    assert offloaded.per_device["vision_tower_bytes"] == 0
    assert offloaded.host["offloaded_weights_bytes"] == pytest.approx(weights, abs=16)  # every rank's shard, the tower's too


def test_images_grow_with_max_pixels_for_dynamic_resolution_only(real_size):
    """Qwen2-VL sees max_pixels / 14^2 patches per image (merged 2 x 2 into language-model tokens);
    Gemma 3 resizes every image to 224 px (this default config's) whatever --max-pixels says."""
    for model_type, grows in (("qwen2_vl", True), ("gemma3", False)):
        tower, element = real_size[model_type].vision, plan.ELEMENT["bf16"]
        small, large = plan.Setup(max_pixels=512 * 512), plan.Setup(max_pixels=2048 * 2048)
        ratio = vision.forward_bytes(tower, large, element) / vision.forward_bytes(tower, small, element)
        lines = [plan.estimate(real_size[model_type], s).per_device["images_bytes"] for s in (small, large)]
        if grows:
            assert vision.patches(tower, 2048 * 2048) == 2048 * 2048 // 196 and vision.image_tokens(tower, 2048 * 2048) == 21399 // 4
            assert ratio == pytest.approx(16, rel=0.01) and lines[1] > 15 * lines[0]
        else:
            assert (vision.patches(tower, 2048 * 2048), vision.image_tokens(tower, 2048 * 2048)) == ((224 // 16) ** 2, 256)
            assert ratio == 1 and lines[0] == lines[1]
    rows = vision.forward_bytes(real_size["qwen2_vl"].vision, plan.Setup(micro_batch_size=4), 2)
    assert rows == 4 * vision.forward_bytes(real_size["qwen2_vl"].vision, plan.Setup(), 2)  # one image per row


def test_a_frozen_towers_forward_counts_where_it_exceeds_the_language_models_peak(real_size):
    """It runs before the language model's layers, and autograd keeps nothing of it."""
    arch = real_size["qwen2_vl"]
    for pixels in (256 * 256, 8192 * 8192):
        setup = plan.Setup(max_pixels=pixels)
        est = plan.estimate(arch, setup).per_device
        forward = vision.forward_bytes(arch.vision, setup, 2)
        language = est["activations_bytes"] + est["logits_bytes"]
        assert est["images_bytes"] == vision.pixel_bytes(arch.vision, setup) + max(0, forward - language)
    assert forward > language  # 342,000 patches: the tower's forward is the step's peak


def test_train_vision_adds_the_towers_lora_and_keeps_its_activations(real_size):
    """Every linear of SigLIP's blocks gets LoRA (q, k, v, out; fc1, fc2); Gemma 3's projector has none."""
    arch = real_size["gemma3"]
    frozen, trained = plan.Setup(), plan.Setup(train_vision=True)
    w, i, r = arch.vision.width, arch.vision.intermediate, 16
    per_layer = 4 * r * (w + w) + 2 * r * (w + i)
    assert (w, i, arch.vision.layers) == (768, 3072, 12)
    head = r * (w + w) + 2 * r * (w + i)  # the default config keeps SigLIP's pooling head (out_proj, fc1, fc2): peft adapts it too
    assert plan.estimate(arch, trained).trainable_parameters - plan.estimate(arch, frozen).trainable_parameters == per_layer * 12 + head
    images = plan.estimate(arch, trained).per_device["images_bytes"]
    assert images == vision.pixel_bytes(arch.vision, trained) + arch.vision.layers * vision.forward_bytes(arch.vision, trained, 2)
    assert "--train-vision" in render.train_command("gemma3-27b", trained)
    assert "--max-pixels 500000" in render.train_command("x", replace(frozen, max_pixels=500_000))
    assert "--max-pixels" not in render.train_command("x", frozen)


# --- the tower's forward, measured -------------------------------------------------------------------
SIDE, PATCH = 256, 8  # 32 x 32 = 1,024 patches per image, from 8-pixel patches
WIDTH, MLP = 256, 1024  # the real towers' proportions: i ~ 4 w, C p^2 ~ w / 2


def _wide_tower(model_type: str):
    overrides = {"vision_config.patch_size": PATCH}
    if model_type == "gemma3":  # without SigLIP's pooling head, as Gemma 3's checkpoints (its output is not used)
        overrides |= {"mm_tokens_per_image": 16, "vision_config.image_size": SIDE, "vision_config.vision_use_head": False}
    if model_type == "llava":
        overrides |= {"vision_config.image_size": SIDE}
    if model_type == "qwen2_vl":
        overrides |= {"vision_config.embed_dim": WIDTH, "vision_config.mlp_ratio": MLP // WIDTH}
    else:
        overrides |= {"vision_config.hidden_size": WIDTH, "vision_config.intermediate_size": MLP}
    if model_type == "mistral3":
        overrides |= {"vision_config.head_dim": WIDTH // 4}
    return shrink_config(CONFIG_MAPPING[model_type](), overrides=overrides)


def _pixels(model_type: str, config, images: int) -> dict:
    """A batch of SIDE x SIDE images as the family's processor lays them out."""
    grid = SIDE // PATCH
    if model_type == "qwen2_vl":  # flattened patches, each repeated over temporal_patch_size frames
        frames = config.vision_config.temporal_patch_size
        return dict(
            pixel_values=torch.randn(images * grid * grid, 3 * frames * PATCH * PATCH),
            image_grid_thw=torch.tensor([[1, grid, grid]] * images),
        )
    pixels = torch.randn(images, 3, SIDE, SIDE)
    return (
        dict(pixel_values=pixels, image_sizes=torch.tensor([[SIDE, SIDE]] * images))
        if model_type == "mistral3"
        else dict(pixel_values=pixels)
    )


# (family, precision, attention, images): the plan's error bounds against the measured peak.
MEASURED = [
    ("gemma3", "bf16", "sdpa", 1, (0.0, 0.10)),
    ("gemma3", "bf16", "sdpa", 2, (0.0, 0.10)),
    ("gemma3", "fp32", "sdpa", 1, (0.0, 0.10)),
    ("gemma3", "bf16", "eager", 1, (-0.05, 0.05)),
    ("llava", "bf16", "sdpa", 1, (0.0, 0.10)),
    ("llava", "bf16", "eager", 1, (-0.05, 0.05)),
    ("qwen2_vl", "bf16", "sdpa", 1, (0.0, 0.25)),  # rotary copies planned as Pixtral's (10 w); measured ~8 w
    ("qwen2_vl", "fp32", "sdpa", 1, (0.0, 0.55)),  # in fp32 its rotary upcast copies nothing: conservative
    ("mistral3", "bf16", "sdpa", 1, (0.0, 0.10)),
    ("mistral3", "bf16", "eager", 1, (-0.05, 0.05)),
]


@pytest.mark.parametrize("model_type, precision, attention, images, bounds", MEASURED)
def test_the_towers_forward_is_planned_within_bounds_of_its_measured_peak(model_type, precision, attention, images, bounds):
    """The live tensor bytes of the tower and projector's forward (what the model's forward runs on a
    micro-batch's images), frozen, in the compute dtype under autocast, against the plan."""
    config = _wide_tower(model_type)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attention).to(dtype).eval().requires_grad_(False)
    inputs = _pixels(model_type, config, images)
    # oneDNN off: its convolution scratchpad depends on the CPU's instruction set, not on the model (one 25 MB
    # block for SigLIP's 3-channel 8x8 patch convolution in bf16 on an AMX Xeon, 4x the whole forward's
    # planned 6.7 MB; GPUs have no such workspace); PyTorch's own convolution computes the same patches.
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), torch.backends.mkldnn.flags(enabled=False):
        model.model.get_image_features(**inputs)  # warm: lazily built buffers (rotary tables) are not the forward's
        with cpu_tensor_peak() as peak:
            model.model.get_image_features(**inputs)
    setup = plan.Setup(precision=precision, attention=attention, micro_batch_size=images, max_pixels=SIDE * SIDE)
    planned = vision.forward_bytes(Architecture.from_config(config.to_dict()).vision, setup, plan.ELEMENT[precision])
    low, high = bounds
    assert peak.bytes * (1 + low) <= planned <= peak.bytes * (1 + high), (planned, peak.bytes, planned / peak.bytes - 1)


def _saved_by_the_tower(path, checkpointing: Checkpointing) -> int:
    """Bytes autograd keeps for backward from the tower's forward, with LoRA on the language model."""
    cfg = TrainConfig(base=str(path), data="d", output_dir="o", precision="bf16", rank=8)
    model = add_lora(load_base_model(str(path), "bf16", torch.device("cpu")), cfg, "b", checkpointing=checkpointing)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model.base_model.model.model.get_image_features(pixel_values=torch.randn(2, 3, 64, 64, dtype=torch.bfloat16))
    return sum(saved.values())


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_train_visions_lora_is_planned_as_peft_adds_it(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    cfg = TrainConfig(base=str(path), data="d", output_dir="o", precision="bf16", rank=8, train_vision=True)
    model = add_lora(load_base_model(str(path), "bf16", torch.device("cpu")), cfg, "b", checkpointing=Checkpointing(False))
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert sum(v for n, v in trainable.items() if "language_model" not in n) > 0
    assert plan.estimate(load_architecture(str(path)), plan.setup_from(cfg)).trainable_parameters == sum(trainable.values())


def test_a_frozen_tower_keeps_nothing_for_backward(tiny_checkpoints):
    assert _saved_by_the_tower(tiny_checkpoints["gemma3"], Checkpointing(False)) == 0


def test_a_frozen_tower_keeps_nothing_for_backward_under_gradient_checkpointing(tiny_checkpoints):
    # transformers' enable_input_require_grads hooks the tower's patch embedding too; the adapter
    # requires grads from the language model's embeddings only (models/adapter.py).
    assert _saved_by_the_tower(tiny_checkpoints["gemma3"], Checkpointing(True)) == 0


def test_the_runs_memory_plan_counts_the_tower(tiny_checkpoints):
    path = tiny_checkpoints["gemma3"]
    cfg = TrainConfig(base=str(path), data="d", output_dir="o", precision="bf16", max_pixels=300_000)
    logger, said = logging.getLogger("lora_tune"), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger.addHandler(handler)
    try:
        planned = memory_plan(cfg, torch.device("cpu"))
    finally:
        logger.removeHandler(handler)
    table = planned.out_of_memory_advice[0]
    assert "vision_tower" in table and "images" in table
    assert any("one image per sequence assumed, 16 patches per image (fixed 64 px images)" in line for line in said), said
    estimate = plan.estimate(load_architecture(str(path)), plan.setup_from(cfg))
    assert estimate.per_device["vision_tower_bytes"] == 2 * load_architecture(str(path)).vision.params
