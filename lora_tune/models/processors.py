"""An image-text checkpoint's own processor (`AutoProcessor`), for what training needs of it: how
many tokens an image becomes (the processor expands the placeholder the chat template writes, per
family: Gemma 3's soft tokens between begin/end tokens, LLaVA's repeated `<image>`, the Qwen-style
grid of merged patches), the pixel inputs the model's forward takes, the ids never trained on, and
the token types some families want (Gemma 3's `token_type_ids`, the multimodal rotary families'
`mm_token_type_ids`), all from the processor's and the config's own declarations.

Loading it is tolerant: a text run on an image-text checkpoint (today's use) must not need it, so a
processor that can't load is kept as the reason and said only when a row brings an image. A processor
whose video processor can't be built (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: it needs torchvision, which
CPU-only installs lack) is built without it, from the image processor (PIL/numpy) and the tokenizer:
images train as usual, and video parts are refused by the data formats, which train none.
"""

from __future__ import annotations

import hashlib
import json
import logging

import torch
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

from lora_tune.errors import first_line
from lora_tune.models.structure import is_image_text, meta_model, multimodal_body

log = logging.getLogger("lora_tune")

TOKEN_TYPE_INPUTS = ("token_type_ids", "mm_token_type_ids")  # 1 on image tokens, 0 elsewhere


IMAGE_KEYS = ("image", "vision", "boi", "eoi")  # config ids of image tokens and their begin/end markers
# Processor attributes naming the markers an expansion adds around or inside an image (Pixtral's
# row breaks and end, Idefics' wrappers).
MARKER_ATTRIBUTES = ("boi_token", "eoi_token", "image_start_token", "image_end_token", "image_break_token", "fake_image_token")


def _image_token_ids(config, processor) -> set[int]:
    """The ids the config and the processor name for image tokens and their markers."""
    ids = set()
    for key, value in config.to_dict().items():
        if any(k in key for k in IMAGE_KEYS) and key.endswith(("_token_id", "_token_index")) and isinstance(value, int):
            ids.add(value)
    tokenizer = processor.tokenizer
    for name in MARKER_ATTRIBUTES:
        token = getattr(processor, name, None) or getattr(tokenizer, name, None)
        if isinstance(token, str) and token in tokenizer.get_vocab():
            ids.add(tokenizer.convert_tokens_to_ids(token))
    return ids


class ImageText:
    """The processor of an image-text base, with --max-pixels / --min-pixels."""

    def __init__(self, processor, config, max_pixels: int, min_pixels: int = 0, body=None):
        self.processor = processor
        self.placeholder = processor.image_token  # what the chat template writes once per image
        image_key = next((k for k in ("image_token_id", "image_token_index") if isinstance(getattr(config, k, None), int)), None)
        if image_key is None:
            raise ValueError("the config names no image token id (image_token_id / image_token_index)")
        self.image_token_id = getattr(config, image_key)  # the tokens the vision features replace
        self.masked_ids = _image_token_ids(config, processor) | {processor.tokenizer.convert_tokens_to_ids(self.placeholder)}
        self.max_pixels, self.min_pixels = max_pixels, min_pixels
        self.pixel_keys = [k for k in processor.model_input_names if k not in ("input_ids", "attention_mask", *TOKEN_TYPE_INPUTS)]
        # Processors that return multimodal token types say so by a flag, not in model_input_names.
        wanted = [*processor.model_input_names, *(["mm_token_type_ids"] if getattr(processor, "return_mm_token_type_ids", False) else [])]
        self.token_types = [k for k in TOKEN_TYPE_INPUTS if k in wanted]
        self.packing_refusal = packing_refusal(config, body, self.token_types)

    def fingerprint(self) -> str:
        """What decides the tokens an image becomes: the processor's settings and the pixel bounds."""
        image = self.processor.image_processor.to_dict()
        text = {k: v for k, v in self.processor.to_dict().items() if k not in ("image_processor", "tokenizer", "chat_template")}
        blob = json.dumps([image, text, self.max_pixels, self.min_pixels], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def expand(self, text: str, images: list) -> list[int]:
        """Token ids of `text`, each placeholder expanded to its image's tokens (no special tokens added)."""
        out = self.processor(text=[text], images=images or None, add_special_tokens=False)
        return list(out["input_ids"][0])

    def pixel_inputs(self, images: list) -> dict[str, torch.Tensor]:
        """What the model's forward takes for these images, in order (pixel values, grids, sizes)."""
        out = self.processor.image_processor(images=images, return_tensors="pt")
        return {k: out[k] for k in self.pixel_keys if k in out}

    def token_type_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        marks = (input_ids == self.image_token_id).long()
        return {k: marks for k in self.token_types}


def packing_refusal(config, body, token_types: list[str]) -> str | None:
    """Why rows with images can't be packed exactly on this family, or None. Packed rows restart
    `position_ids` per sample and attend causally within each (lora_tune.data.batching); that is the
    padded computation only where an image's tokens take plain 1-D positions and causal attention:
    not with multimodal rotary positions computed over the whole sequence (`get_rope_index`: Qwen-VL,
    PaddleOCR-VL, GLM-4V), nor where token types give an image's tokens attention both ways or their
    own positions (Gemma 3's `token_type_ids`, `mm_token_type_ids`)."""
    if body is not None and hasattr(body, "get_rope_index"):
        return f"{config.model_type} computes multimodal rotary positions over the whole sequence"
    if token_types:
        return f"{config.model_type}'s image tokens take token types ({', '.join(token_types)})"
    return None


def load_image_text(base_path: str, config, cfg) -> ImageText | str | None:
    """The base's processor (None for a text model); a string says why it can't load (said when a row
    brings an image)."""
    if not is_image_text(config):
        return None
    try:
        processor = AutoProcessor.from_pretrained(base_path, trust_remote_code=cfg.trust_remote_code)
    except ImportError as e:
        missing = first_line(e)[:160]
        processor = without_video(base_path, config, cfg.trust_remote_code)
        if processor is None:
            return f"--base {cfg.base}: its processor needs a package that is missing ({missing}); install it (pip install torchvision)"
        log.info(
            "processor: %s without its video processor (%s); images train as usual, video inputs are refused",
            type(processor).__name__,
            missing,
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        return f"--base {cfg.base}: its image processor can't be loaded ({first_line(e)[:160]}); the folder needs the processor files"
    if not hasattr(processor, "image_processor") or not getattr(processor, "image_token", None):
        return f"--base {cfg.base}: its processor ({type(processor).__name__}) has no image processor or image token"
    try:
        body = multimodal_body(meta_model(config))
        if body is None:
            apart = f"{config.model_type} keeps its vision tower apart from the decoder"
            return f"--base {cfg.base}: {apart}; training on its images is not supported yet"
        return ImageText(processor, config, cfg.max_pixels, cfg.min_pixels, body)
    except (ValueError, TypeError, AttributeError, KeyError) as e:  # said only when a row brings an image
        return f"--base {cfg.base}: its images can't be prepared for training ({first_line(e)[:160]})"


def without_video(base_path: str, config, trust_remote_code: bool):
    """The base's processor built from its image processor and tokenizer alone, where its class also
    takes a video processor (None where it takes other parts, or these can't load). transformers
    builds a processor from the parts `get_attributes()` names; this class of it names no video
    processor, so the image processor (the PIL/numpy one when torchvision is missing) and the
    tokenizer make it whole. Its chat template is the processor's own (chat_template.jinja/json)."""
    cls = PROCESSOR_MAPPING.get(type(config), None)
    try:
        parts = sorted(cls.get_attributes()) if cls is not None else []
    except ImportError:  # the class itself needs the missing package (transformers' placeholder: Pixtral's)
        return None
    if parts != ["image_processor", "tokenizer", "video_processor"]:
        return None
    try:
        images = AutoImageProcessor.from_pretrained(base_path, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(base_path, trust_remote_code=trust_remote_code)
        saved, _ = cls.get_processor_dict(base_path)
    except (ImportError, OSError, ValueError) as e:
        log.info("processor without its video processor: can't be built either (%s)", first_line(e)[:160])
        return None
    return image_only(cls)(images, tokenizer, chat_template=saved.get("chat_template"))


def image_only(cls):
    """`cls` (a processor class of image, tokenizer and video parts) without the video part: its own
    __init__ passes the parts on positionally, and transformers pairs them with `get_attributes()`."""

    def get_attributes(kind) -> list[str]:
        return [a for a in cls.get_attributes() if a != "video_processor"]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    # The same name: what the processor writes and fingerprints (processor_class) is the family's.
    return type(cls.__name__, (cls,), {"__init__": __init__, "get_attributes": classmethod(get_attributes), "video_processor": None})
