"""What an export reads and writes: the source (a run, merged tensor by tensor on the fly, or a merged
folder), reference logits to verify against, and the output put in place atomically."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel
from transformers.utils import logging as hf_logging

from lora_tune.after.merge import applying, reading, writing
from lora_tune.after.merge.reading import latest_adapter, tokenizer_folder
from lora_tune.after.options import ExportConfig
from lora_tune.after.serving import read_config
from lora_tune.errors import UserError
from lora_tune.files import remove_tree
from lora_tune.models import shards
from lora_tune.models.adapter import peft_building
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
    base: Path | None = None  # a run's base folder

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def by_name(self) -> dict:
        return {t.name: t for t in self.tensors}


def open_source(cfg: ExportConfig) -> Source:
    """A run folder (adapter_config.json) or a merged folder (config.json + safetensors); headers only."""
    folder = latest_adapter(Path(cfg.source).expanduser())
    if not folder.is_dir():
        raise UserError(f"{cfg.source} does not exist; give a training run's --output-dir or a merged model folder")
    if (folder / "adapter_config.json").is_file():
        adapter_config, weights = reading.read_adapter(folder)
        base_ref = cfg.base or adapter_config.get("base_model_name_or_path")
        if not base_ref:
            raise UserError(f"--base: {folder}/adapter_config.json records no base; pass --base")
        base = reading.base_folder(base_ref)
        config = read_config(base / "config.json", "--base")
        tensors = [t for group in writing.plan_output(shards.weight_files(base), torch.float32, 1 << 62) for t in group]
        tokenizer_dir = tokenizer_folder(folder, base)
        if adapter_config.get("target_parameters"):  # refused by the format
            return Source("run", folder, config, tokenizer_dir, tensors, None, None, folder, adapter_config, base=base)
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
            base,
        )
    if (folder / "config.json").is_file():
        files = shards.shard_files(folder)
        if files is None:
            raise UserError(f"{folder} has no .safetensors weights; give a merged folder written by `lora-tune merge` or save_pretrained")
        config = read_config(folder / "config.json", "export")
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
    with peft_building():
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def model_logits(folder: Path, ids: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    hf_logging.disable_progress_bar()
    auto = auto_class(load_config(str(folder), trust_remote_code))
    model = auto.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def check_format(out: Path, fmt: str) -> None:
    """The kind of output a format writes (what may be written there: `outputs.check_output`)."""
    if fmt in ("gguf", "gguf-lora") and out.suffix != ".gguf":
        raise UserError(f"--output: {out} should be a FILE.gguf for --format {fmt}")
    if fmt == "ollama" and out.exists() and not out.is_dir():
        raise UserError(f"--output: {out} is a file; --format ollama writes a folder (GGUF + Modelfile)")
    if fmt != "ollama" and out.is_dir():
        raise UserError(f"--output: {out} is a folder; give a FILE.gguf")


def is_gguf(path: Path) -> bool:
    """A GGUF file (its magic): what an export may replace inside a run's folder."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


@contextmanager
def staged(out: Path):
    """A hidden temporary folder beside `out` to write the export into, removed whatever happens; a
    write the machine refuses (full disk, read-only, no permission) is one line, exit 1."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        remove_tree(tmp)
        tmp.mkdir(parents=True)
        yield tmp
    except OSError as e:
        raise UserError(
            f"--output: could not write {out} ({e.strerror or e}); nothing was left behind. Free space or choose another --output",
            exit_code=1,
        ) from None
    finally:
        remove_tree(tmp)


def put_in_place(tmp: Path, out: Path) -> None:
    """Rename into place; an existing output (--overwrite) is only removed once the new one is there."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        remove_tree(old)
    else:
        os.replace(tmp, out)
