"""Tensor names and layouts on disk vs in the module tree, converted with transformers' own objects.

transformers 5 converts some checkpoints while loading (per-expert MoE tensors fused into 3-D
parameters, routers renamed, an image-text wrapper's `language_model.model.*` moved to
`model.language_model.*`) and converts them back while saving. Whatever reads or writes safetensors
itself (layer-by-layer loading, the streaming merge) applies the same conversions, per tensor group,
never through a hand-kept table: the transforms are `get_model_conversion_mapping(model)` (what
from_pretrained uses), driven the way `core_model_loading` drives them on load
(`rename_source_key`, then each `WeightConverter`'s operations) and on save
(`revert_weight_conversion`).

    layout = CheckpointLayout(skeleton, disk_keys)        # a meta-device model is enough
    layout.groups[model_key]                                # the disk keys that model tensor is built from
    layout.disk_to_model({disk_key: tensor, ...})           # any complete groups, e.g. one layer's
    layout.model_to_disk({model_key: tensor, ...})          # back to the names and layouts on disk
"""

from __future__ import annotations

import re
from copy import deepcopy

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key, revert_weight_conversion


def natural_order(key: str) -> list:
    """Sort key that puts layer 10 after layer 9 (and expert 10 after expert 9)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


class CheckpointLayout:
    """How one model's checkpoint maps onto its module tree: model key -> its disk keys."""

    def __init__(self, model, disk_keys):
        self.model = model
        self.transforms = get_model_conversion_mapping(model, add_legacy=True)
        self.renamings = [t for t in self.transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in self.transforms if isinstance(t, WeightConverter)]
        self.model_state = model.state_dict()
        self.source: dict[str, tuple[str, str | None]] = {}  # disk key -> (model key, converter source pattern)
        self.groups: dict[str, list[str]] = {}
        for key in sorted(disk_keys, key=natural_order):
            target, pattern = self.model_key_of(key)
            if target in self.model_state:  # else from_pretrained would report it unexpected
                self.source[key] = (target, pattern)
                self.groups.setdefault(target, []).append(key)

    def model_key_of(self, disk_key: str) -> tuple[str, str | None]:
        """(model key, matching converter source pattern or None) of one checkpoint key."""
        key, pattern = rename_source_key(disk_key, self.renamings, self.converters, self.model.base_model_prefix, self.model_state)
        if key not in self.model_state and disk_key in self.model_state:
            return disk_key, None  # stored under the model's own name
        return key, pattern

    @property
    def is_identity(self) -> bool:
        """Every tensor is stored under its model name, unconverted."""
        return all(group == [key] for key, group in self.groups.items())

    def is_renaming(self, model_key: str) -> bool:
        """The model tensor is one disk tensor, renamed at most (same values and shape)."""
        group = self.groups.get(model_key, [])
        return len(group) == 1 and self.source[group[0]][1] is None

    def disk_to_model(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (complete groups) -> the model's tensors, through the converters from_pretrained runs."""
        by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        pending: dict[str, object] = {}
        for key in sorted(tensors, key=natural_order):
            if key not in self.source:
                continue
            target, pattern = self.source[key]
            if pattern is None:
                transform, pattern = pending.setdefault(target, WeightRenaming(key, target)), key
            else:
                transform = pending.setdefault(target, deepcopy(by_pattern[pattern]))
            transform.add_tensor(target, key, pattern, (lambda t: lambda: t)(tensors[key]))
        out: dict[str, torch.Tensor] = {}
        for target, transform in pending.items():
            produced = transform.convert(target, model=self.model, config=self.model.config)
            for name, value in produced.items():
                out[name] = value[0] if isinstance(value, list) else value
            if target not in out:
                raise KeyError(f"{type(transform).__name__} for {target} produced {sorted(produced)}")
        return out

    def model_to_disk(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors (complete subsets, e.g. one merged layer) -> checkpoint names and
        layouts, as save_pretrained writes them."""
        return revert_weight_conversion(self.model, dict(tensors))
