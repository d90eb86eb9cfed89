"""`lora-tune export`: a run or a merged folder as a GGUF file (llama.cpp, LM Studio), a llama.cpp LoRA
adapter, or an Ollama folder (GGUF + Modelfile); read back and verified before it is put in place.

The source is read as `merge` reads it: from a run, each tensor of the full-precision base is merged
with the adapter in fp32 (lora_tune.merger's TensorMerger) and handed to the writer one at a time;
from a merged folder, tensors are read shard by shard. Either way nothing holds the whole model.

Everything goes into a hidden temporary folder next to --output; the file is verified there and only
then renamed into place, so a crash or a failed check leaves nothing that looks complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lora_tune.config import ExportConfig
from lora_tune.errors import UserError

log = logging.getLogger("lora_tune")


@dataclass
class Source:
    """Where the (merged) model's tensors, config and tokenizer come from."""

    kind: str  # "run" or "merged"
    folder: Path
    config: dict
    tokenizer_dir: Path
    tensors: list  # merger.PlannedTensor, in shard order
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
    from lora_tune import merger

    folder = Path(cfg.source).expanduser()
    if not folder.is_dir():
        raise UserError(f"{cfg.source} does not exist; give a training run's --output-dir or a merged model folder")
    if (folder / "adapter_config.json").is_file():
        adapter_config, weights = merger.read_adapter(folder)
        base_ref = cfg.base or adapter_config.get("base_model_name_or_path")
        if not base_ref:
            raise UserError(f"--base: {folder}/adapter_config.json records no base; pass --base")
        base = merger.base_folder(base_ref)
        config = json.loads((base / "config.json").read_text())
        tensors = [t for group in merger.plan_output(merger.base_shards(base), torch.float32, 1 << 62) for t in group]
        if adapter_config.get("target_parameters"):
            return Source("run", folder, config, folder, tensors, None, None, folder, adapter_config)  # refused by the format
        modules, replacements = merger.lora_modules(adapter_config, weights)
        transposed = merger.transposed_weights(base, cfg.trust_remote_code)
        if transposed is None:
            transposed = set(modules) if adapter_config.get("fan_in_fan_out") else set()
        missing = sorted((set(modules) | set(replacements)) - {t.name for t in tensors})
        if missing:
            raise UserError(f"--base: the adapter targets {missing[0]} (and {len(missing) - 1} more) which the base does not have; this adapter was trained on another base")
        tensor_merger = merger.TensorMerger(modules, replacements, transposed, torch.float32, verify=False)
        tokenizer_dir = folder if (folder / "tokenizer_config.json").is_file() else base
        return Source("run", folder, config, tokenizer_dir, tensors, tensor_merger, lambda ids: peft_logits(base, folder, ids, cfg.trust_remote_code),
                      folder, adapter_config, tensor_merger.close)
    if (folder / "config.json").is_file():
        shards = merger.base_shards(folder) if list(folder.glob("*.safetensors")) else None
        if shards is None:
            raise UserError(f"{folder} has no .safetensors weights; give a merged folder written by `lora-tune merge` or save_pretrained")
        config = json.loads((folder / "config.json").read_text())
        tensors = [t for group in merger.plan_output(shards, torch.float32, 1 << 62) for t in group]
        reader = merger.TensorMerger({}, {}, set(), torch.float32, verify=False)
        return Source("merged", folder, config, folder, tensors, reader, lambda ids: model_logits(folder, ids, cfg.trust_remote_code), close=reader.close)
    raise UserError(f"{folder} holds neither an adapter (adapter_config.json) nor a model (config.json); give a run's --output-dir or a merged folder")


def peft_logits(base: Path, adapter_dir: Path, ids: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def model_logits(folder: Path, ids: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
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


def run(cfg: ExportConfig):
    """Export; returns the verification figures (`gguf.RoundTrip`) with `.path` set."""
    from lora_tune.exporting import gguf as gguf_format

    try:
        import gguf  # noqa: F401 - optional dependency, checked before anything heavy
    except ImportError:
        raise UserError('export: the gguf package is missing; pip install "lora-tune[export]" (or pip install gguf)') from None
    out = Path(cfg.output).expanduser()
    check_output(out, cfg.format, cfg.overwrite)
    source = open_source(cfg)
    if cfg.format == "gguf-lora":
        from lora_tune.exporting import gguf_lora

        return gguf_lora.run(cfg, source, out)
    if source.produce is None:
        raise UserError(f"--format {cfg.format}: the adapter adapts fused tensors ({', '.join(source.adapter_config['target_parameters'])}); "
                        "merge first (`lora-tune merge`), then serve the merged folder with vLLM or transformers")
    family = gguf_format.family_of(source.config)
    planned = gguf_format.plan_tensors(source.config, family, [(t.name, t.shape) for t in source.tensors], cfg.quant)
    name = f"{source.config.get('model_type', 'model')}-{source.folder.name}"
    if family.general_name_hint and family.general_name_hint not in name.lower():
        name = f"{family.general_name_hint}-{name}"
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        gguf_path = tmp / "model.gguf"
        by_name = source.by_name
        t0 = time.perf_counter()
        gguf_format.write(gguf_path, source.config, family, planned, lambda t: source.produce(by_name[t.hf_name]).float(), source.tokenizer_dir, cfg.quant, name)
        source.close()
        seconds = time.perf_counter() - t0
        log.info("wrote %s: %d tensors, %.2f GB (%s) in %.1fs", out.name, len(planned), gguf_path.stat().st_size / 1e9, cfg.quant, seconds)
        result = verify(gguf_path, source, family, planned, cfg) if cfg.verify else gguf_format.RoundTrip(len(planned), notes=["not verified (--no-verify)"])
        result.seconds = seconds
        if cfg.format == "ollama":
            from lora_tune.exporting import ollama

            ollama.write_modelfile(tmp, source.tokenizer_dir, source.config, "model.gguf")
            if cfg.verify:
                ollama.check_modelfile(tmp / "Modelfile", source.tokenizer_dir)
            put_in_place(tmp, out)
            result.path = out
        else:
            put_in_place(gguf_path, out)
            shutil.rmtree(tmp, ignore_errors=True)
            result.path = out
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--output: could not write {out} ({e.strerror or e}); nothing was left behind. Free space or choose another --output", exit_code=1) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s to %s", cfg.format, out)
    return result


def put_in_place(tmp: Path, out: Path) -> None:
    """Rename into place; an existing output (--overwrite) is only removed once the new one is there."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, out)


def verify(path: Path, source: Source, family, planned, cfg: ExportConfig):
    """Read back (tensors, shapes, metadata), tokenizer ids, and - up to 100M parameters - logits of
    transformers' GGUF loader vs the merged model on fixed prompts."""
    from lora_tune.exporting import gguf as gguf_format

    gguf_format.check_file(path, planned, source.config, family)
    result = gguf_format.RoundTrip(len(planned))
    result.token_ids_equal = gguf_format.check_tokenizer(path, source.tokenizer_dir)
    if not result.token_ids_equal:
        raise UserError("verification failed: the tokenizer rebuilt from the GGUF encodes the fixed text to other ids (or other BOS/EOS/chat template) "
                        "than the original; nothing was kept", exit_code=1)
    if source.n_params > gguf_format.FULL_CHECK_MAX_PARAMS:
        result.notes.append(f"logits not compared: {source.n_params / 1e9:.1f}B parameters (the check holds two models in RAM up to {gguf_format.FULL_CHECK_MAX_PARAMS / 1e6:.0f}M)")
        log.info("verify: %s", result.notes[-1])
        return result
    ids = gguf_format.fixed_prompts(source.tokenizer_dir, source.config["vocab_size"])
    want = source.reference(ids)
    config, filled = gguf_format.reading_config(path, source.config)
    if filled:
        result.notes.append(f"transformers' GGUF reader has no key for {', '.join(filled)} on this architecture: taken from the source for the logits check")
        log.info("verify: %s", result.notes[-1])
    got = gguf_format.gguf_logits(path, ids, config)
    gguf_format.compare(got, want, cfg.quant, result)
    log.info("verify: logits through transformers' GGUF loader vs the merged model: max diff %.2e (relative %.2e), greedy agreement %.2f%%, tokenizer ids equal",
             result.max_abs_logit_diff, result.max_rel_logit_diff, 100 * result.greedy_agreement)
    return result

