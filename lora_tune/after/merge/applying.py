"""The merge arithmetic, tensor by tensor: peft's own operation order (`W + (B @ A) * scale`, DoRA's
`m / ||W + s BA|| * (W + s BA)`) in fp32, so an fp32 merge is bit-identical to `merge_and_unload()`;
one cast to the output dtype at the end."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lora_tune.after.merge.reading import DiskAdapter, LoraModule
from lora_tune.after.merge.verifying import VERIFY_LAYERS, all_finite, expert_rows, verify_expert, verify_layer
from lora_tune.after.merge.writing import PlannedTensor
from lora_tune.errors import UserError

log = logging.getLogger("lora_tune")


def merged_weight(weight: torch.Tensor, lora: LoraModule, fan_in_fan_out: bool, name: str) -> torch.Tensor:
    """fp32 merge of one weight, in peft's operation order."""
    w = weight.float()
    a, b = lora.a.float(), lora.b.float()
    out_features, in_features = (w.shape[1], w.shape[0]) if fan_in_fan_out else (w.shape[0], w.shape[1])
    if a.shape[1] != in_features or b.shape[0] != out_features or a.shape[0] != b.shape[1]:
        raise UserError(
            f"--base: {name} has shape {tuple(w.shape)} but the adapter has A {tuple(a.shape)}, B {tuple(b.shape)}; this "
            "adapter was trained on another base"
        )
    delta = b @ a
    delta = (delta.T if fan_in_fan_out else delta) * lora.scale
    if lora.magnitude is None:
        return w + delta
    # DoRA: norm per output row of the unmerged weight + delta, as peft's DoraLinearLayer does.
    w_rows = w.T if fan_in_fan_out else w
    delta_rows = delta.T if fan_in_fan_out else delta
    norm = torch.linalg.norm(w_rows + delta_rows, dim=1)
    factor = (lora.magnitude.float() / norm).view(-1, 1)
    factor = factor.T if fan_in_fan_out else factor
    return factor * (w + delta)


def merged_experts(weight: torch.Tensor, lora: LoraModule, name: str) -> torch.Tensor:
    """fp32 merge of a fused (experts, out, in) or (experts, in, out) tensor, expert by expert (the
    delta of all experts at once would double the peak)."""
    w = weight.to(torch.float32, copy=True)  # merged in place: the base stays for verification
    for e in range(lora.experts):
        a, b = expert_rows(lora, e)
        delta = (b @ a) * lora.scale  # (out, in)
        if (delta.T if lora.in_first else delta).shape != w[e].shape:
            raise UserError(
                f"--base: {name} has shape {tuple(weight.shape)} but the adapter has A {tuple(lora.a.shape)}, B {tuple(lora.b.shape)}; "
                "this adapter was trained on another base"
            )
        w[e] += delta.T if lora.in_first else delta
    return w


class TensorMerger:
    """Produces each output tensor on demand: read it from its base shard, merge in fp32 when the
    adapter touches it, check it is finite, cast once. A disk tensor that is part of a converted
    group (one expert of a fused tensor) comes with its whole group: read, converted to the model's
    layout, merged, converted back; the group's other tensors wait for their turn. Sampled LoRA
    layers are verified on the spot against the unmerged LoRA forward."""

    def __init__(self, adapter: DiskAdapter, dtype: torch.dtype, verify: bool, sources: dict[str, Path] | None = None):
        self.adapter, self.dtype = adapter, dtype
        self.sources = sources or {}  # disk name -> shard, for reading a group across shards
        self.group_of = {d: key for key in adapter.fused for d in adapter.layout.groups[key]} if adapter.fused else {}
        self.ready: dict[str, torch.Tensor] = {}  # merged tensors of a group, until written
        n_loras = len(adapter.modules) + len(adapter.fused)
        self.verify_every = max(1, n_loras // VERIFY_LAYERS) if verify else 0
        self.layer_drifts: list[float] = []
        self.merged = 0
        self.shard_path: Path | None = None
        self.shard = None

    def _read(self, name: str, source: Path) -> torch.Tensor:
        try:
            if source != self.shard_path:  # tensors arrive in shard order: one shard open at a time
                self.shard, self.shard_path = safe_open(str(source), framework="pt"), source
                log.info("merging %s", source.name)
            return self.shard.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise UserError(f"--base: tensor {name} in {source} is unreadable ({e})") from None

    def _verified(self, check) -> None:
        if self.verify_every and self.merged % self.verify_every == 0:
            self.layer_drifts.append(check())
        self.merged += 1

    def _merge_group(self, key: str) -> None:
        layout, lora = self.adapter.layout, self.adapter.fused[key]
        disk = {}
        for name in layout.groups[key]:
            with safe_open(str(self.sources[name]), framework="pt") as f:
                disk[name] = f.get_tensor(name)
        weight = layout.disk_to_model(disk)[key]
        del disk
        # A fused expert tensor, or a linear's weight the checkpoint stores renamed or transposed
        # (Ergo's `gate_kernel`): merged in the model's layout either way.
        merged = merged_experts(weight, lora, key) if lora.experts else merged_weight(weight, lora, False, key)
        if not all_finite(merged):
            raise UserError(f"merged weight {key} contains NaN/inf; the adapter is broken (check the training metrics)")
        merged = merged.to(self.dtype)  # the one cast
        if lora.experts:
            self._verified(lambda: verify_expert(weight, merged, lora))
        else:
            self._verified(lambda: verify_layer(key, weight, merged, lora, False))
        self.ready.update(layout.model_to_disk({key: merged}))

    def __call__(self, t: PlannedTensor) -> torch.Tensor:
        if t.name in self.group_of:
            if t.name not in self.ready:
                self._merge_group(self.group_of[t.name])
            return self.ready.pop(t.name).contiguous()
        tensor = self._read(t.name, t.source)
        lora = self.adapter.modules.get(t.name)
        fan_in_fan_out = t.name in self.adapter.transposed
        if lora is not None:
            result = merged_weight(tensor, lora, fan_in_fan_out, t.name)
        elif t.name in self.adapter.replacements:
            result = self.adapter.replacements[t.name].float()
            if list(result.shape) != t.shape:
                raise UserError(f"--base: {t.name} has shape {tuple(t.shape)}, the adapter's trained copy {tuple(result.shape)}")
        elif t.name in self.adapter.rows:  # trainable tokens: their trained rows replace the embedding's
            ids, rows = self.adapter.rows[t.name]
            if max(ids) >= t.shape[0] or rows.shape != (len(ids), *t.shape[1:]):
                raise UserError(f"--base: {t.name} has shape {tuple(t.shape)}, the adapter's trained rows {tuple(rows.shape)} for {ids}")
            result = tensor.float().clone()
            result[ids] = rows.float()
        else:
            result = tensor
        if result.is_floating_point():
            if not all_finite(result):
                raise UserError(f"merged weight {t.name} contains NaN/inf; the adapter is broken (check the training metrics)")
            result = result.to(self.dtype)  # the one cast
        if lora is not None:
            self._verified(lambda: verify_layer(t.name, tensor, result, lora, fan_in_fan_out))
        return result

    def close(self) -> None:
        self.shard = self.shard_path = None
