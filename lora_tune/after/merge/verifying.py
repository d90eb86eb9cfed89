"""Proof that the merge is base + adapter: sampled layers against the unmerged LoRA forward, and
(for models up to FULL_CHECK_MAX_PARAMS) whole-model logits against peft's."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from transformers.utils import logging as hf_logging

from lora_tune.after.merge.reading import LoraModule
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
