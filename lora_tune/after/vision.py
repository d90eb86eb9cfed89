"""An image-text checkpoint as the after-training commands see it. Its language model (the decoder
body and the output head: what LoRA adapts, what vLLM's LoRA reaches, what llama.cpp's main GGUF
holds) and the rest (the vision tower and the projector: frozen by training, ignored by vLLM's LoRA,
a separate `mmproj` file for llama.cpp) are told apart by structure on a meta skeleton
(`models.structure.body_path`), never by module names; and the processor files (`AutoProcessor`)
a merged folder needs beside the tokenizer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from lora_tune.models.checkpoint_layout import CheckpointLayout
from lora_tune.models.structure import body_path, meta_model, model_class

# What AutoProcessor reads besides the tokenizer's files (lora_tune.after.merge.writing.TOKENIZER_FILES):
# transformers 5 saves one processor_config.json (the image processor inside it); older processors
# and image processors saved alone write preprocessor_config.json; video processors their own file.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
IMAGE_PROCESSOR_FILES = PROCESSOR_FILES[:2]  # one of them is what makes AutoProcessor an image processor


def is_image_text(config: dict) -> bool:
    """A config.json transformers loads through AutoModelForImageTextToText (its checkpoints are saved from it)."""
    return config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def config_object(config: dict):
    """The transformers config of a config.json, or None for a model it doesn't implement."""
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    try:
        return CONFIG_MAPPING[model_type].from_dict(config)
    except (TypeError, ValueError, KeyError, AttributeError):  # a config.json its class can't read: parts unknown
        return None


@dataclass
class Parts:
    """Where an image-text model's language model sits in its module tree (model names)."""

    skeleton: object  # the model on the meta device
    body: str  # the decoder body's path, e.g. model.language_model
    head: str  # the output head's path ('' without one)

    def is_language(self, module: str) -> bool:
        return module == self.body or module.startswith(f"{self.body}.") or (bool(self.head) and module == self.head)

    @cached_property
    def modules(self) -> set[str]:
        return {name for name, _ in self.skeleton.named_modules()}

    @cached_property
    def layout(self) -> CheckpointLayout:
        return CheckpointLayout(self.skeleton, [])

    def module_of(self, name: str) -> str | None:
        """The skeleton's module an adapter's module name is: as named, or, for a name in an older
        checkpoint layout (`language_model.model.*`), renamed as transformers renames it on load."""
        if name in self.modules:
            return name
        key, _ = self.layout.model_key_of(f"{name}.weight")
        module = key.rsplit(".", 1)[0]
        return module if module in self.modules else None

    def text_name(self, key: str) -> str:
        """A language-model tensor's name in the text model's own checkpoint (`model.layers.0...`, `lm_head.weight`)."""
        if key.startswith(f"{self.body}."):
            return "model." + key[len(self.body) + 1 :]
        return "lm_head." + key[len(self.head) + 1 :]


def parts(config: dict) -> Parts | None:
    """The parts of an image-text model's config.json; None for a text model, one transformers doesn't
    implement, or one whose whole tree is its language model."""
    if not is_image_text(config):
        return None
    obj = config_object(config)
    if obj is None or model_class(obj) is None:
        return None
    skeleton = meta_model(obj)
    body = body_path(skeleton)
    if not body:
        return None
    head_module = skeleton.get_output_embeddings()
    head = next((n for n, m in skeleton.named_modules() if head_module is not None and m is head_module), "")
    return Parts(skeleton, body, head)


def adapted_modules(weight_names) -> set[str]:
    """The modules an adapter changes, from its tensor names: LoRA pairs and DoRA magnitudes (`X.lora_*`)
    and trained copies (modules_to_save, `X.weight`), as peft names them (the loaded model's names)."""
    modules = set()
    for key in weight_names:
        name = key.removeprefix("base_model.model.")
        modules.add(name.split(".lora_")[0] if ".lora_" in name else name.rsplit(".", 1)[0])
    return modules


def vision_modules(config: dict, weight_names) -> list[str]:
    """The modules outside the language model (vision tower, projector) an adapter changes, sorted;
    [] for a text model or one whose parts are unknown (no skeleton)."""
    found = parts(config)
    if found is None:
        return []
    return sorted(m for m in adapted_modules(weight_names) if (module := found.module_of(m)) is not None and not found.is_language(module))
