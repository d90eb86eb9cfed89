"""The merged folder: output shards planned from the base's safetensors headers alone and written
tensor by tensor, its index, config, tokenizer and (image-text models) processor files; and an
--output that can be written."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_tune.after import vision
from lora_tune.after.merge.reading import tokenizer_folder
from lora_tune.errors import UserError, first_line
from lora_tune.files import pid_alive, remove_tree
from lora_tune.models import shards

log = logging.getLogger("lora_tune")


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
CHAT_TEMPLATE_FILES = TOKENIZER_FILES[-2:]


@dataclass
class PlannedTensor:
    name: str
    source: Path  # the base shard it comes from
    shape: list[int]
    dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_output(shards_: list[Path], out_dtype: torch.dtype, max_bytes: int) -> list[list[PlannedTensor]]:
    """Group every base tensor, in order, into output shards of at most max_bytes, from the
    safetensors headers alone (nothing is loaded)."""
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for shard in shards_:
        for name, entry in shards.read_header(shard).items():
            dtype = shards.DTYPES.get(entry.dtype)
            if dtype is None:
                raise UserError(
                    f"--base: {name} in {shard} is stored as {entry.dtype}, which merge does not read; convert the base to bf16/fp16/fp32"
                )
            tensor = PlannedTensor(name, shard, list(entry.shape), out_dtype if dtype.is_floating_point else dtype)
            if groups[-1] and size + tensor.nbytes > max_bytes:
                groups.append([])
                size = 0
            groups[-1].append(tensor)
            size += tensor.nbytes
    return groups


def write_shard(path: Path, planned: list[PlannedTensor], produce) -> None:
    """Write one safetensors file tensor by tensor: the header is known from the plan, so each
    merged tensor goes to disk as soon as it is computed and is then dropped."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in planned:
        header[t.name] = {"dtype": shards.NAMES[t.dtype], "shape": t.shape, "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in planned:
            tensor = produce(t)
            if tensor.dtype != t.dtype or list(tensor.shape) != t.shape:
                raise RuntimeError(f"{t.name}: produced {tensor.dtype} {list(tensor.shape)}, planned {t.dtype} {t.shape}")
            f.write(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().data if tensor.numel() else b"")  # 0-d too


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_index(folder: Path, groups: list[list[PlannedTensor]], names: list[str]) -> None:
    if len(names) == 1:
        return
    weight_map = {t.name: name for group, name in zip(groups, names) for t in group}
    total = sum(t.nbytes for group in groups for t in group)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_side_files(base: Path, adapter_dir: Path, out: Path, dtype: str) -> None:
    """config.json (chosen dtype, no quantization config), generation config, tokenizer files, and the
    processor files (`copy_processor_files`)."""
    config = json.loads((base / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (base / "generation_config.json").is_file():
        shutil.copy2(base / "generation_config.json", out / "generation_config.json")
    source = tokenizer_folder(adapter_dir, base)  # the one training used (chat template included)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    if not any((out / name).is_file() for name in CHAT_TEMPLATE_FILES):  # the base's (a processor's own) template then
        for name in CHAT_TEMPLATE_FILES:
            if (base / name).is_file():
                shutil.copy2(base / name, out / name)
    copy_processor_files(base, adapter_dir, out, vision.is_image_text(config))


def copy_processor_files(base: Path, adapter_dir: Path, out: Path, image_text: bool) -> None:
    """What AutoProcessor reads besides the tokenizer (`vision.PROCESSOR_FILES`): from the adapter's
    folder when training saved them there, else from the base. Each is read (a link followed: a hub
    cache's files are links) and must be a JSON object, or the merge stops in one line naming it, since
    the merged folder's processor would not load; it is written as a plain file of the merged folder."""
    option, source = "--adapter", adapter_dir
    if not any(os.path.lexists(adapter_dir / name) for name in vision.PROCESSOR_FILES):
        option, source = "--base", base
    for name in vision.PROCESSOR_FILES:
        path = source / name
        if not os.path.lexists(path):
            continue
        try:
            data = path.read_bytes()
            if not isinstance(json.loads(data), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
            raise UserError(
                f"{option}: {path} is unreadable or not a processor's JSON ({first_line(e)}); the merged model's processor (AutoProcessor) "
                "would not load. Restore it from the model's source or remove it"
            ) from None
        (out / name).write_bytes(data)
    if image_text and not any((out / name).is_file() for name in vision.IMAGE_PROCESSOR_FILES):
        log.warning(
            "merge: %s has no %s; the merged model loads (AutoModelForImageTextToText) but its processor (AutoProcessor) does not: "
            "copy the processor files of the model's source into it",
            source,
            " or ".join(vision.IMAGE_PROCESSOR_FILES),
        )


def prepare_output(out: Path) -> None:
    """Refuses an --output that can't be written (what may be written there at all is
    `lora_tune.after.outputs.check_output`'s); removes the temporary folders that a merge killed
    outright (SIGKILL) left beside it."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--output: {out} would be inside {existing}, which is a file; give a folder")
    parent = out.parent if out.parent.exists() else existing
    if os.statvfs(parent).f_flag & os.ST_RDONLY or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--output: {parent} can't be written (read-only or no permission); choose another --output")
    if out.parent.is_dir():
        for left in out.parent.glob(f".{out.name}.*-*"):
            kind, _, pid = left.name.removeprefix(f".{out.name}.").partition("-")
            if kind in ("tmp", "old") and pid.isdigit() and not pid_alive(pid):
                log.info("removing %s, left by a merge that was killed", left)
                remove_tree(left)
