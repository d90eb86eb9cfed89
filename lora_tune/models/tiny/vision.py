"""Tiny image-text checkpoints, offline: a shrunk wrapper config (`shrink_config`), images of a few
dozen pixels a side, the tiny tokenizer with the family's image tokens added at the ids the shrunk
config reserved for them, the family's own processor class, and a chat template that renders image
parts the way the family's real template does. Saved with `save_pretrained` (weights, processor
files, chat template), so everything after goes through the real `AutoProcessor` /
`AutoModelForImageTextToText` loading.

Families: `paddleocr_vl` (multimodal rotary positions, a Qwen-style grid of merged patches),
`gemma3` (a projector, token type ids, fixed image size), `llava` (a projector, repeated `<image>`).
Qwen-VL, Qwen3.5, Gemma 4, Mistral 3 and Llama 4 processors need torchvision (their video or fast
image processors), which this machine's CPU build of torch has no working wheel for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

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
    # 14-pixel patches merged 2 x 2: a 56 x 56 image is 4 tokens; bounded to 8 x 8 patches.
    images = transformers.PaddleOCRVLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)
    return transformers.PaddleOCRVLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)


def build_tiny_image_text_model(model_type: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a loadable tiny image-text checkpoint of `model_type` (see FAMILIES) with its processor."""
    added, image_text, changes = FAMILIES[model_type]
    config = shrink_config(CONFIG_MAPPING[model_type](), overrides=changes or None)
    tokenizer = train_tiny_tokenizer(extra_special_tokens=added)
    template = _TEMPLATE.replace("IMAGE", image_text)
    tokenizer.chat_template = template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # Gemma 3 initialises its projection to zeros: every image would look the same
        for name, p in model.named_parameters():
            if "projector" in name and p.dim() > 1 and not p.any():
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    _processor(model_type, tokenizer, template).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return out
