"""Check lora_tune.models.checkpoint_layout against transformers itself, per layer, on tiny checkpoints of
the families whose on-disk layout differs from the module tree.

For each family: a tiny random model (lora_tune.models.tiny.configs.shrink_config) is saved with
save_pretrained; then, one decoder layer at a time,
  disk -> model   the layer's checkpoint tensors (grouped by group_disk_keys on a meta skeleton)
                  through disk_to_model must equal what from_pretrained loaded, bit for bit;
  model -> disk   the loaded layer's tensors through model_to_disk must give back the file's
                  names and values, bit for bit.

    python benchmarks/conversion_roundtrip.py [--only mixtral,gemma3]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import warnings
from pathlib import Path

FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "jamba",
    "phimoe",
    "minimax",
    "qwen3_next",
    "gemma3",
    "mistral3",
    "llava",
    "gpt_oss",
    "llama4",
    "qwen3_5_moe",
)


def check(model_type: str, root: Path) -> str:
    import torch
    from safetensors import safe_open
    from transformers import CONFIG_MAPPING

    from lora_tune.models.checkpoint_layout import CheckpointLayout
    from lora_tune.models.structure import auto_class
    from lora_tune.models.tiny.configs import shrink_config

    config = shrink_config(CONFIG_MAPPING[model_type]())
    auto = auto_class(config)
    torch.manual_seed(0)
    folder = root / model_type
    auto.from_config(config).save_pretrained(folder)
    files = sorted(folder.glob("*.safetensors"))
    disk = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            disk.update({k: h.get_tensor(k) for k in h.keys()})
    loaded = auto.from_pretrained(folder, dtype=torch.float32)
    want = loaded.state_dict()
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    layout = CheckpointLayout(skeleton, disk)
    groups = layout.groups

    def layer_of(key):
        found = re.search(r"layers\.(\d+)\.", key)
        return found[1] if found else None

    layers = sorted({layer_of(k) for k in groups if layer_of(k) is not None}, key=int)
    converted = 0
    for layer in layers + [None]:  # each decoder layer, then everything outside the layers
        keys = [k for k in groups if layer_of(k) == layer]
        part = {d: disk[d] for k in keys for d in groups[k]}
        got = layout.disk_to_model(part)
        for k in keys:
            assert torch.equal(got[k], want[k]), f"disk->model {k}"
            converted += len(groups[k]) > 1 or groups[k][0] != k
        back = layout.model_to_disk({k: want[k] for k in keys})
        assert set(back) == set(part), f"model->disk names for layer {layer}: {sorted(set(back) ^ set(part))[:4]}"
        for d, t in back.items():
            assert torch.equal(t, disk[d]), f"model->disk {d}"
    missing = sorted(set(want) - set(groups))
    tied = set(getattr(loaded, "all_tied_weights_keys", {}) or {})
    assert all(k in tied for k in missing), f"model keys with no checkpoint tensor: {missing[:3]}"
    names = sorted({type(t).__name__ for t in layout.transforms if t.was_used()}) or ["none"]
    counts = f"{len(disk)} disk tensors -> {len(groups)} model tensors ({converted} renamed or fused)"
    return f"ok: {len(layers)} layers + rest; {counts}; transforms used: {', '.join(names)}"


def main() -> int:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    p = argparse.ArgumentParser()
    p.add_argument("--only")
    a = p.parse_args()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for t in a.only.split(",") if a.only else FAMILIES:
            try:
                print(f"{t:14s} {check(t, Path(tmp))}", flush=True)
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"{t:14s} FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
