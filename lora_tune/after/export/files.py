"""What an export reads and writes: the source (a run, merged tensor by tensor on the fly, or a merged
folder), reference logits to verify against, and the output put in place atomically."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel
from transformers.utils import logging as hf_logging

from lora_tune.after.merge import applying, reading, writing
from lora_tune.after.options import ExportConfig
from lora_tune.errors import UserError
from lora_tune.models import shards
from lora_tune.models.loading import load_config
from lora_tune.models.structure import auto_class


@dataclass
class Source:
    """Where the (merged) model's tensors, config and tokenizer come from."""

    kind: str  # "run" or "merged"
    folder: Path
    config: dict
    tokenizer_dir: Path
    tensors: list  # writing.PlannedTensor, in shard order
    produce: Callable  # PlannedTensor -> fp32 tensor (merged when the source is a run)
    reference: Callable  # token ids -> fp32 logits of the merged model (base + adapter through peft for a run)
    adapter_dir: Path | None = None
    adapter_config: dict = field(default_factory=dict)
    close: Callable = lambda: None

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def by_name(self) -> dict:
        return {t.name: t for t in self.tensors}


def open_source(cfg: ExportConfig) -> Source:
    """A run folder (adapter_config.json) or a merged folder (config.json + safetensors); headers only."""
    folder = Path(cfg.source).expanduser()
    if not folder.is_dir():
        raise UserError(f"{cfg.source} does not exist; give a training run's --output-dir or a merged model folder")
    if (folder / "adapter_config.json").is_file():
        adapter_config, weights = reading.read_adapter(folder)
        base_ref = cfg.base or adapter_config.get("base_model_name_or_path")
        if not base_ref:
            raise UserError(f"--base: {folder}/adapter_config.json records no base; pass --base")
        base = reading.base_folder(base_ref)
        config = json.loads((base / "config.json").read_text())
        tensors = [t for group in writing.plan_output(shards.weight_files(base), torch.float32, 1 << 62) for t in group]
        if adapter_config.get("target_parameters"):
            return Source("run", folder, config, folder, tensors, None, None, folder, adapter_config)  # refused by the format
        sources = {t.name: t.source for t in tensors}
        adapter = reading.disk_adapter(base, folder, adapter_config, weights, sources, cfg.trust_remote_code)
        adapter = adapter or reading.named_adapter(adapter_config, weights)
        missing = sorted((set(adapter.modules) | set(adapter.replacements)) - set(sources))
        if missing:
            raise UserError(
                f"--base: the adapter targets {missing[0]} (and {len(missing) - 1} more) which the base does not have; this "
                "adapter was trained on another base"
            )
        tensor_merger = applying.TensorMerger(adapter, torch.float32, verify=False, sources=sources)
        tokenizer_dir = folder if (folder / "tokenizer_config.json").is_file() else base
        return Source(
            "run",
            folder,
            config,
            tokenizer_dir,
            tensors,
            tensor_merger,
            lambda ids: peft_logits(base, folder, ids, cfg.trust_remote_code),
            folder,
            adapter_config,
            tensor_merger.close,
        )
    if (folder / "config.json").is_file():
        files = shards.shard_files(folder)
        if files is None:
            raise UserError(f"{folder} has no .safetensors weights; give a merged folder written by `lora-tune merge` or save_pretrained")
        config = json.loads((folder / "config.json").read_text())
        tensors = [t for group in writing.plan_output(files, torch.float32, 1 << 62) for t in group]
        reader = applying.TensorMerger(reading.DiskAdapter({}, {}, {}, set()), torch.float32, verify=False)
        return Source(
            "merged",
            folder,
            config,
            folder,
            tensors,
            reader,
            lambda ids: model_logits(folder, ids, cfg.trust_remote_code),
            close=reader.close,
        )
    raise UserError(
        f"{folder} holds neither an adapter (adapter_config.json) nor a model (config.json); give a run's --output-dir or a merged folder"
    )


def peft_logits(base: Path, adapter_dir: Path, ids: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    hf_logging.disable_progress_bar()
    auto = auto_class(load_config(str(base), trust_remote_code))
    model = auto.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def model_logits(folder: Path, ids: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    hf_logging.disable_progress_bar()
    auto = auto_class(load_config(str(folder), trust_remote_code))
    model = auto.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def check_output(out: Path, fmt: str, overwrite: bool) -> None:
    if fmt in ("gguf", "gguf-lora") and out.suffix != ".gguf":
        raise UserError(f"--output: {out} should be a FILE.gguf for --format {fmt}")
    if fmt == "ollama" and out.exists() and not out.is_dir():
        raise UserError(f"--output: {out} is a file; --format ollama writes a folder (GGUF + Modelfile)")
    if fmt != "ollama" and out.is_dir():
        raise UserError(f"--output: {out} is a folder; give a FILE.gguf")
    exists = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if exists and not overwrite:
        raise UserError(f"--output: {out} already exists; choose another path or pass --overwrite")


def put_in_place(tmp: Path, out: Path) -> None:
    """Rename into place; an existing output (--overwrite) is only removed once the new one is there."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, out)
