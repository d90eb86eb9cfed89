"""Tiny image-text checkpoints, offline: a shrunk wrapper config (`shrink_config`), images of a few
dozen pixels a side, the tiny tokenizer with the family's image tokens added at the ids the shrunk
config reserved for them, the family's own processor class, and a chat template that renders image
parts the way the family's real template does. Saved with `save_pretrained` (weights, processor
files, chat template), so everything after goes through the real `AutoProcessor` /
`AutoModelForImageTextToText` loading.

Families: `paddleocr_vl` (multimodal rotary positions, a Qwen-style grid of merged patches),
`gemma3` (a projector, token type ids, fixed image size), `llava` (a projector, repeated `<image>`),
`qwen2_vl`, `qwen2_5_vl` (multimodal rotary positions; Qwen2.5-VL's tower attends in windows),
`qwen3_5` (Qwen3.5: a hybrid gated-delta-net / attention decoder with interleaved multimodal rotary
positions and `mm_token_type_ids`). The Qwen families' processors bundle a video processor that needs
torchvision, which this machine's CPU build of torch has no working wheel for: there the processor is
built without it (`lora_tune.models.processors.image_only`, what training does with such a base) and
the video processor's settings are written beside the rest, so the folder holds a real checkpoint's
processor files. (Gemma 4's, Mistral 3's and Llama 4's processors need torchvision for their images
too: they build only where it imports; their classes are looked up only when asked for.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

from lora_tune.models.processors import image_only
from lora_tune.models.tiny.configs import shrink_config
from lora_tune.models.tiny.model import train_tiny_tokenizer

# Rendered image parts, as each family's own template writes them (Qwen: start, pad, end; Gemma 3:
# its begin-of-image token, which the processor expands to the image's soft tokens).
_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

QWEN_VISION_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
FAMILIES = {
    # model type: (image tokens added in the shrunk config's id order, named as the family's
    # tokenizer names them; how the template writes one image; config changes)
    "paddleocr_vl": (
        {
            "image_token": "<|IMAGE_PLACEHOLDER|>",
            "video_token": "<|VIDEO_PLACEHOLDER|>",
            "vision_start": "<|IMAGE_START|>",
            "vision_end": "<|IMAGE_END|>",
        },
        "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
        # The model splits each head's rotary frequencies into (time, height, width) sections; its
        # default split is for head_dim 128, the tiny heads' 16 take a tiny split.
        {"text_config.rope_parameters": {"rope_theta": 500000.0, "rope_type": "default", "mrope_section": [2, 3, 3]}},
    ),
    "gemma3": (
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        "<start_of_image>",
        # 64-pixel images in 16-pixel patches: 4 x 4 patches pooled to 2 x 2 = 4 image tokens.
        {"mm_tokens_per_image": 4, "vision_config.image_size": 64},
    ),
    "llava": (
        {"image_token": "<image>"},
        "<image>",
        # 28-pixel images in 14-pixel patches: 4 image tokens (the CLS feature dropped).
        {"vision_config.image_size": 28},
    ),
    # Qwen2-VL and Qwen2.5-VL (multimodal rotary positions over a Qwen-style grid of merged patches):
    # the shrunk config's 16-wide heads split their rotary (2, 3, 3) over (time, height, width).
    "qwen2_vl": (QWEN_VISION_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>", {}),
    "qwen2_5_vl": (
        QWEN_VISION_TOKENS,
        "<|vision_start|><|image_pad|><|vision_end|>",
        # Its tower attends in windows of `window_size` pixels (the real 112: 4 x 4 merged patches)
        # but in some blocks over the whole image, as the real one does in 4 of 32: windows of 2 x 2
        # merged patches (56 pixels), and the second block whole.
        {"vision_config.window_size": 56, "vision_config.fullatt_block_indexes": [1]},
    ),
    "qwen3_5": (
        QWEN_VISION_TOKENS,
        "<|vision_start|><|image_pad|><|vision_end|>",
        {
            # The merger projects into the decoder's hidden size (the default config's 3584 is not the
            # default text config's 4096, so the shrunk one follows neither).
            "vision_config.out_hidden_size": 64,
            # Rotary on half of each 16-wide head: 4 frequencies, interleaved (time, height, width)
            # as the real [11, 11, 10] does on 32, so an image's grid position reaches the attention.
            "text_config.rope_parameters": {
                "rope_theta": 10000.0,
                "rope_type": "default",
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        },
    ),
}


# The Qwen families' processors: (processor class, video processor class, image and video sizes).
# Qwen2-VL, Qwen2.5-VL: 14-pixel patches merged 2 x 2, two frames a temporal patch, as the real
# processor's: a 56 x 56 image is 4 tokens; bounded to 8 x 8 patches (16 tokens). Qwen3.5: 16-pixel
# patches: a 64 x 64 image is 4 tokens; bounded to 4 x 4 merged patches (16 tokens).
QWEN2_VL_SIZES = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
}
QWEN3_5_SIZES = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
}
QWEN = {
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor", QWEN2_VL_SIZES),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", QWEN2_VL_SIZES),
    "qwen3_5": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor", QWEN3_5_SIZES),
}


def _processor(model_type: str, tokenizer, template: str):
    """The family's processor class around the tiny tokenizer, sized for tiny images."""
    import transformers  # noqa: PLC0415 - the family's classes, by name

    if model_type == "gemma3":
        images = transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
        return transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=template, image_seq_length=4)
    if model_type == "llava":
        images = transformers.LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
        return transformers.LlavaProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            chat_template=template,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
    if model_type in QWEN:
        family, videos, sizes = QWEN[model_type]
        family, images = getattr(transformers, family), transformers.Qwen2VLImageProcessorPil(**sizes)
        try:
            videos = getattr(transformers, videos)(**sizes)  # needs torchvision
        except ImportError:  # its settings are written as it would write them (write_video_processor)
            return image_only(family)(image_processor=images, tokenizer=tokenizer, chat_template=template)
        return family(image_processor=images, tokenizer=tokenizer, video_processor=videos, chat_template=template)
    # 14-pixel patches merged 2 x 2: a 56 x 56 image is 4 tokens; bounded to 8 x 8 patches.
    images = transformers.PaddleOCRVLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)
    return transformers.PaddleOCRVLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)


def write_video_processor(model_type: str, out: Path) -> None:
    """A processor built without its video processor (no torchvision here) saved the rest; the video
    processor's settings go where the family's processor keeps them (processor_config.json's
    `video_processor`), so the folder holds the processor files a real checkpoint does."""
    _, videos, sizes = QWEN[model_type]
    file = out / "processor_config.json"
    saved = json.loads(file.read_text())
    saved["video_processor"] = {"video_processor_type": videos, **sizes}
    file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def build_tiny_image_text_model(model_type: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a loadable tiny image-text checkpoint of `model_type` (see FAMILIES) with its processor."""
    added, image_text, changes = FAMILIES[model_type]
    config = shrink_config(CONFIG_MAPPING[model_type](), overrides=changes or None)
    tokenizer = train_tiny_tokenizer(extra_special_tokens=added)
    template = _TEMPLATE.replace("IMAGE", image_text)
    tokenizer.chat_template = template
    processor = _processor(model_type, tokenizer, template)  # first: a processor that can't be built writes nothing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # Gemma 3 initialises its projection to zeros: every image would look the same
        for name, p in model.named_parameters():
            if "projector" in name and p.dim() > 1 and not p.any():
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    if getattr(processor, "video_processor", False) is None:  # built without it (models.processors.image_only)
        write_video_processor(model_type, out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return out
