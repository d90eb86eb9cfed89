"""`--format gguf-lora`: the adapter alone as a llama.cpp LoRA adapter (`llama-server --lora FILE`,
Ollama's `ADAPTER FILE`), next to a GGUF of its base.

llama.cpp's adapter format (convert_lora_to_gguf.py, llama-adapter.cpp): general.type "adapter",
adapter.type "lora", one adapter.lora.alpha, and per adapted weight `<gguf name>.lora_a` (A, r x in)
and `<gguf name>.lora_b` (B, out x r); at run time llama.cpp adds (alpha / r) * B(Ax) with r read
from each A. What the base's GGUF layout changes changes B too: Q/K rows are permuted for the
rotary layout (rows of B are output rows), GPT-2's Conv1D deltas are already (out, in) as B @ A.
Per-module scales (rsLoRA, rank_pattern, alpha_pattern) are folded into B, since the file has one alpha.

Verified by applying the file the way llama.cpp does to a GGUF of the base (W + alpha/r * B @ A in
GGML layout), reading that through transformers' GGUF loader and comparing its logits with base +
adapter through peft.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from lora_tune.after import serving
from lora_tune.after.export import gguf as gguf_format
from lora_tune.after.export import gguf_check
from lora_tune.after.export.files import peft_logits, put_in_place, staged
from lora_tune.after.merge import applying, reading
from lora_tune.errors import UserError

log = logging.getLogger("lora_tune")


def lora_tensors(source, family, quant: str):
    """[(planned tensor, fp32 data in GGML layout)] for every LoRA pair, and the file's alpha."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    adapter_config, weights = reading.read_adapter(source.adapter_dir)
    modules, replacements = reading.lora_modules(adapter_config, weights)
    config = source.config
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    name_map = gguf.get_tensor_name_map(arch, config.get("num_hidden_layers") or config.get("n_layer"))
    alpha = float(adapter_config["lora_alpha"])
    out = []
    for hf_name, lora in sorted(modules.items()):
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(
                f"--format gguf-lora: {hf_name} has no name in llama.cpp's layout; export the merged model instead (--format gguf)"
            )
        a, b = lora.a.float(), lora.b.float()
        rank = a.shape[0]
        b = b * (lora.scale / (alpha / rank))  # llama.cpp applies alpha / r: fold the module's own scale into B
        probe = gguf_format.PlannedGgufTensor(hf_name, gguf_name, tuple(b.shape), None)
        if family.rotary_permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            b = gguf_format.to_gguf_layout(probe, b, config, family)
        for suffix, data in ((".lora_a", a), (".lora_b", b)):
            shape = tuple(data.shape)
            t = gguf_format.PlannedGgufTensor(hf_name, gguf_name + suffix, shape, gguf_format.tensor_type(quant, shape, gguf_name + suffix))
            out.append((t, data))
    return out, alpha


def write_adapter(path: Path, source, family, tensors, alpha: float) -> None:
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name(f"{source.folder.name} (LoRA)")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for t, data in tensors:  # small: the adapter, not the model, so written in one go
        writer.add_tensor(t.gguf_name, gguf_format.encode(t, data), raw_dtype=None if t.qtype.name in ("F32", "F16") else t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_adapter_gguf(path: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """{base gguf name: (A, B)} and alpha, read back with gguf's reader (dequantized to fp32)."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    reader = gguf.GGUFReader(path)
    if reader.fields["general.type"].contents() != "adapter" or reader.fields["adapter.type"].contents() != "lora":
        raise UserError(f"verification failed: {path.name} does not read back as a LoRA adapter", exit_code=1)
    alpha = float(reader.fields["adapter.lora.alpha"].contents())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        shape = tuple(int(d) for d in reversed(t.shape))
        parts.setdefault(base, {})[kind] = torch.from_numpy(
            np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        )
    return {k: (v["lora_a"], v["lora_b"]) for k, v in parts.items()}, alpha


def verify(path: Path, source, family, tensors, quant: str, work: Path) -> gguf_check.RoundTrip:
    """Read back; then apply the adapter to a GGUF of the base as llama.cpp does and compare that
    model's logits (transformers' GGUF loader) with base + adapter through peft."""
    pairs, alpha = read_adapter_gguf(path)
    if len(pairs) * 2 != len(tensors):
        raise UserError(f"verification failed: {path.name} holds {2 * len(pairs)} LoRA tensors, {len(tensors)} were written", exit_code=1)
    result = gguf_check.RoundTrip(len(tensors))
    if source.n_params > gguf_check.FULL_CHECK_MAX_PARAMS:
        result.notes.append("logits not compared: base above 100M parameters")
        return result
    base_reader = applying.TensorMerger(reading.DiskAdapter({}, {}, {}, set()), torch.float32, verify=False)
    planned = gguf_format.plan_tensors(source.config, family, [(t.name, t.shape) for t in source.tensors], "f16")
    by_name = source.by_name
    for t in planned:
        if t.make is not None:
            continue

        def applied(t=t):
            w = gguf_format.to_gguf_layout(t, base_reader(by_name[t.hf_name]).float(), source.config, family)
            if t.gguf_name in pairs:
                a, b = pairs[t.gguf_name]
                w = w + (alpha / a.shape[0]) * (b @ a)  # llama.cpp: scale = alpha / rank, rank from A
            return w

        t.make = applied
    check_path = work / "base-with-adapter.gguf"
    gguf_format.write(check_path, source.config, family, planned, None, source.tokenizer_dir, "f16", f"{source.folder.name}-check")
    base_reader.close()
    ids = gguf_check.fixed_prompts(source.tokenizer_dir, source.config["vocab_size"])
    want = peft_logits(reading.base_folder(source.adapter_config["base_model_name_or_path"]), source.adapter_dir, ids, False)
    config, filled = gguf_check.reading_config(check_path, source.config)
    got = gguf_check.gguf_logits(check_path, ids, config)
    gguf_check.compare(got, want, quant if quant in gguf_check.LOGITS_TOLERANCE else "f16", result)
    result.token_ids_equal = None
    log.info(
        "verify: base GGUF + this adapter applied as llama.cpp applies it, vs base + adapter (peft): max diff %.2e (relative "
        "%.2e), greedy agreement %.2f%%",
        result.max_abs_logit_diff,
        result.max_rel_logit_diff,
        100 * result.greedy_agreement,
    )
    return result


def run(cfg, source, out: Path) -> gguf_check.RoundTrip:
    if source.kind != "run":
        raise UserError(
            "--format gguf-lora: give a training run's folder (the adapter); a merged folder has no adapter left. Use --format gguf for it"
        )
    facts = serving.AdapterFacts.from_adapter_config(source.adapter_config, source.config.get("model_type", ""))
    problems = serving.llama_cpp_problems(facts)
    if problems:
        raise UserError("--format gguf-lora: " + "; ".join(problems))
    if cfg.quant == "q8_0":
        raise UserError("--format gguf-lora: q8_0 is for whole models; write the adapter as f16 or bf16 (it is small)")
    family = gguf_format.family_of(source.config)
    tensors, alpha = lora_tensors(source, family, cfg.quant)
    with staged(out) as tmp:
        t0 = time.perf_counter()
        path = tmp / "adapter.gguf"
        write_adapter(path, source, family, tensors, alpha)
        seconds = time.perf_counter() - t0
        log.info("wrote %s: %d LoRA tensors (%s), alpha %g", out.name, len(tensors), cfg.quant, alpha)
        result = (
            verify(path, source, family, tensors, cfg.quant, tmp)
            if cfg.verify
            else gguf_check.RoundTrip(len(tensors), notes=["not verified (--no-verify)"])
        )
        result.seconds = seconds
        put_in_place(path, out)
        result.path = out
    log.info("exported gguf-lora to %s", out)
    return result
