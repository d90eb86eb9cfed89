"""Tiny image-text checkpoints, offline: a shrunk wrapper config (`shrink_config`), images of a few
dozen pixels a side, the tiny tokenizer with the family's image tokens added at the ids the shrunk
config reserved for them, the family's own processor class, and a chat template that renders image
parts the way the family's real template does. Saved with `save_pretrained` (weights, processor
files, chat template), so everything after goes through the real `AutoProcessor` /
`AutoModelForImageTextToText` loading.

Families: `paddleocr_vl` (multimodal rotary positions, a Qwen-style grid of merged patches),
`gemma3` (a projector, token type ids, fixed image size), `llava` (a projector, repeated `<image>`),
`qwen3_5` (Qwen3.5: a hybrid gated-delta-net / attention decoder with interleaved multimodal rotary
positions and `mm_token_type_ids`). Qwen3.5's processor needs torchvision (its video processor), as
do Qwen-VL's, Gemma 4's, Mistral 3's and Llama 4's: this machine's CPU build of torch has no working
torchvision wheel, so that family builds only where torchvision imports (its processor classes are
looked up only when it is asked for).
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
    "qwen3_5": (
        {
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
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
    if model_type == "qwen3_5":
        # 16-pixel patches merged 2 x 2, two frames a temporal patch, as the real processor's: a
        # 64 x 64 image is 4 tokens; bounded to 4 x 4 merged patches (16 tokens).
        sizes = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
        bounds = {"size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}}
        images = transformers.Qwen2VLImageProcessorPil(**sizes, **bounds)
        videos = transformers.Qwen3VLVideoProcessor(**sizes, **bounds)  # needs torchvision
        return transformers.Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos, chat_template=template)
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
    processor = _processor(model_type, tokenizer, template)  # first: a missing torchvision writes nothing
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
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return out
