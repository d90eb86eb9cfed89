"""Proof that the merge is base + adapter: sampled layers against the unmerged LoRA forward, (for
models up to FULL_CHECK_MAX_PARAMS) whole-model logits against peft's, and an image-text model's
vision tower and projector, which the adapter leaves alone, read back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers.utils import logging as hf_logging

from lora_tune.after import vision
from lora_tune.after.merge.reading import LoraModule
from lora_tune.errors import UserError
from lora_tune.models import shards
from lora_tune.models.adapter import peft_building
from lora_tune.models.checkpoint_layout import CheckpointLayout
from lora_tune.models.loading import load_config
from lora_tune.models.structure import auto_class, text_ids

# Relative drift (max |merged - reference| / max |reference|) accepted per output dtype: fp32 is
# exact up to summation order; bf16/fp16 carry the rounding of the final cast.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 4e-2}


FULL_CHECK_MAX_PARAMS = 100_000_000  # up to this size, also compare whole-model logits


VERIFY_LAYERS = 16  # LoRA layers checked against peft's own layer, spread over the model


def relative_drift(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def verify_logits(base: Path, adapter_dir: Path, merged: Path, trust_remote_code: bool) -> float:
    """Whole model: logits of the merged folder vs base (fp32) + adapter through peft."""
    hf_logging.disable_progress_bar()
    auto = auto_class(load_config(str(base), trust_remote_code))
    reference = auto.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust_remote_code)
    with peft_building():
        reference = PeftModel.from_pretrained(reference, adapter_dir).eval()
    ids = text_ids(reference, (2, 24), seed=0)
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
    del reference
    model = auto.from_pretrained(merged, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    return relative_drift(got, want)


def unmerged_forward(x: torch.Tensor, base_w: torch.Tensor, lora: LoraModule, fan_in_fan_out: bool) -> torch.Tensor:
    """What base + adapter compute for input x, the way the unmerged LoRA layer computes it
    (activations through A then B, never the merged weight): the independent reference the
    merged weight must reproduce. DoRA follows peft's DoraLinearLayer: the magnitude over the
    row norm of the unmerged W + scale * BA, applied to base output plus LoRA output."""
    w = (base_w.T if fan_in_fan_out else base_w).float()  # (out, in)
    a, b = lora.a.float(), lora.b.float()
    base_out = x @ w.T
    lora_out = (x @ a.T) @ b.T * lora.scale
    if lora.magnitude is None:
        return base_out + lora_out
    norm = torch.linalg.norm(w + lora.scale * (b @ a), dim=1)
    return (lora.magnitude.float() / norm) * (base_out + lora_out)


def verify_layer(name: str, base_w: torch.Tensor, merged_w: torch.Tensor, lora: LoraModule, fan_in_fan_out: bool) -> float:
    """One layer: the merged weight (as written, in the output dtype) vs the unmerged forward."""
    in_f = base_w.shape[0] if fan_in_fan_out else base_w.shape[1]
    x = torch.randn(4, in_f, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = unmerged_forward(x, base_w, lora, fan_in_fan_out)
        w = merged_w.float()
        got = x @ (w if fan_in_fan_out else w.T)
    return relative_drift(got, want)


def all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """isfinite in slices: the whole-tensor check would allocate a mask as large as an
    embedding matrix (tens of MB) just to answer yes."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def expert_rows(lora: LoraModule, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one expert of a fused tensor's adapter, as peft's ParamWrapper splits them."""
    a = lora.a.float().reshape(lora.experts, -1, lora.a.shape[-1])[expert]  # (r, in)
    b = lora.b.float().reshape(lora.b.shape[0], -1, lora.experts)[:, :, expert]  # (out, r)
    return a, b


def verify_expert(base_w: torch.Tensor, merged_w: torch.Tensor, lora: LoraModule) -> float:
    """Expert 0 of a fused tensor: the merged weight vs its unmerged LoRA forward."""
    orient = (lambda w: w.T) if lora.in_first else (lambda w: w)  # noqa: E731 - (out, in) view of either layout
    return verify_layer("", orient(base_w[0]), orient(merged_w[0]), LoraModule(*expert_rows(lora, 0), lora.scale), False)


def _tensor(entry: shards.Entry, name: str) -> torch.Tensor:
    with safe_open(str(entry.file), framework="pt") as f:
        return f.get_tensor(name)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def verify_vision(base: Path, merged: Path, adapter_dir: Path) -> int | None:
    """An image-text model's vision tower and projector tensors that the adapter does not adapt are, in
    the merged folder, the base's bit for bit (cast to the dtype they are written in, --dtype). Returns
    how many were compared (None: not an image-text model transformers implements); one that differs or
    is missing is a UserError naming it."""
    config = json.loads((base / "config.json").read_text())
    parts = vision.parts(config)
    if parts is None or config.get("quantization_config"):
        return None  # a quantized base is dequantized by transformers' loader: nothing there is copied bit for bit
    adapted = {parts.module_of(m) or m for m in vision.adapted_modules(shards.read_header(adapter_dir / "adapter_model.safetensors"))}
    base_entries, out_entries = shards.read_headers(base), shards.read_headers(merged)
    base_layout, out_layout = CheckpointLayout(parts.skeleton, base_entries), CheckpointLayout(parts.skeleton, out_entries)
    compared = 0
    for key, group in base_layout.groups.items():
        module = key.rsplit(".", 1)[0]
        if parts.is_language(module) or module in adapted or not base_layout.is_renaming(key):
            continue  # the language model's, adapted, or converted on load (fused experts: a language model's)
        if not out_layout.is_renaming(key):
            raise UserError(
                f"verification failed: {group[0]} of the vision tower / projector is missing from the merged model; nothing was written"
            )
        (written,) = out_layout.groups[key]
        want, got = _tensor(base_entries[group[0]], group[0]), _tensor(out_entries[written], written)
        if want.is_floating_point() and got.is_floating_point():
            want = want.to(got.dtype)
        if not same_bits(want, got):
            raise UserError(
                f"verification failed: {written} of the vision tower / projector differs from the base's {group[0]} (the adapter does "
                "not adapt it, so it must be copied bit for bit); nothing was written"
            )
        compared += 1
    return compared
