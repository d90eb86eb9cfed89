"""What a GGUF holds of an image-text model. llama.cpp runs one as two files: the language model's GGUF
and the vision tower + projector's (`mmproj`, written by llama.cpp's own convert_hf_to_gguf.py
--mmproj). Export writes the first only, under the text model's own names (`model.layers.*`,
`lm_head.weight`) when its language model is a family it exports (LLaVA's Llama, Mistral or Qwen2);
one line says that the mmproj is not written and where it comes from. Any other image-text model is
refused in one line that says the same of the mmproj.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from lora_tune.after import vision
from lora_tune.after.export import gguf as gguf_format
from lora_tune.errors import UserError
from lora_tune.models import shards
from lora_tune.models.checkpoint_layout import CheckpointLayout

log = logging.getLogger("lora_tune")


@dataclass
class Exported:
    """The model a GGUF holds: the source's config and tensors, or an image-text model's language model."""

    config: dict
    names: dict[str, str]  # name in the GGUF's source model -> the source's tensor name
    family: gguf_format.Family
    notes: list[str] = field(default_factory=list)


def exported(source, fmt: str, out: Path) -> Exported:
    """What `--format gguf|ollama` writes of `source` (lora_tune.after.export.files.Source)."""
    config = source.config
    names = [t.name for t in source.tensors]
    if not vision.is_image_text(config):
        return Exported(config, {n: n for n in names}, gguf_format.family_of(config))
    model_type = config.get("model_type")
    parts = vision.parts(config)
    if parts is None:
        raise UserError(
            f"--format {fmt}: {model_type} is an image-text model whose language model can't be told apart here (no transformers "
            "implementation), and export never writes the vision projector (llama.cpp's mmproj); run llama.cpp's convert_hf_to_gguf.py "
            "(and --mmproj) on the merged folder (`lora-tune merge`) instead"
        )
    text = parts.skeleton.config.get_text_config().to_dict()
    try:
        family = gguf_format.family_of(text)
    except UserError as e:
        raise UserError(
            f"--format {fmt}: {model_type} is an image-text model; export writes its language model only (never the vision projector, "
            f"llama.cpp's mmproj), and that is refused too: {str(e).removeprefix('--format gguf: ')}"
        ) from None
    layout = CheckpointLayout(parts.skeleton, names)
    renamed, left_out = {}, 0
    for name in names:
        key = layout.source[name][0] if name in layout.source else None
        if key is not None and not parts.is_language(key.rsplit(".", 1)[0]):
            left_out += 1
        else:  # a tensor the model doesn't know keeps its name: plan_tensors refuses it by name
            renamed[parts.text_name(key) if key is not None and layout.is_renaming(key) else name] = name
    text["tie_word_embeddings"] = f"{parts.head}.weight" not in layout.groups  # not stored: llama.cpp reads token_embd
    line = mmproj_line(source, config, f"{out.name}/model.gguf" if fmt == "ollama" else out.name, text["model_type"], left_out)
    log.warning("%s", line)
    return Exported(text, renamed, family, [line])


def mmproj_line(source, config: dict, written: str, text_type: str, left_out: int) -> str:
    """The one line: what the file holds, that the mmproj is not written, and where to take it from."""
    said = (
        f"export: {config.get('model_type')} is an image-text model: {written} holds its language model ({text_type}) only; its vision "
        f"tower and projector ({left_out} tensors, llama.cpp's mmproj file) are not written, take the mmproj from elsewhere: "
    )
    if source.kind == "run":
        adapted = vision.vision_modules(config, shards.read_header(source.adapter_dir / "adapter_model.safetensors"))
        if not adapted:
            return said + (
                "the base's own mmproj GGUF fits (this adapter leaves the vision tower and projector as they are), or llama.cpp's "
                "convert_hf_to_gguf.py --mmproj on the base"
            )
        return said + (
            f"this adapter changes {len(adapted)} of their modules, so only an mmproj made from the merged model fits: llama.cpp's "
            "convert_hf_to_gguf.py --mmproj on the `lora-tune merge` output"
        )
    return said + f"llama.cpp's convert_hf_to_gguf.py --mmproj on {source.folder}"
