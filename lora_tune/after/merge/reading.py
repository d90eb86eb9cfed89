"""The adapter, read and mapped onto the base's tensors on disk: which base tensor each LoRA pair
adapts (peft injecting the adapter's own config into a meta skeleton of the base) under the
checkpoint's own names (transformers' conversion mapping, `models.checkpoint_layout`)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils.other import get_pattern_key
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers.pytorch_utils import Conv1D

from lora_tune.errors import UserError, first_line
from lora_tune.models.adapter_types.registry import TYPES
from lora_tune.models.aliases import resolve_base
from lora_tune.models.checkpoint_layout import CheckpointLayout
from lora_tune.models.loading import load_config
from lora_tune.models.structure import meta_model, model_class
from lora_tune.models.targets import lora_layers, lora_target
from lora_tune.training import checkpoint as ckpt
from lora_tune.training.run_folder import ADAPTER_FILES

log = logging.getLogger("lora_tune")

# peft's names of the other adapter types lora-tune trains (lora_tune.models.adapter_types): peft merges them.
OTHER_TYPES = tuple(name.upper() for name in TYPES if name != "lora")


@dataclass
class LoraModule:
    """The adapter pieces for one base weight. A fused expert tensor (peft's ParamWrapper) stacks one
    rank-r pair per expert: A is (r * experts, in), B (out, r * experts)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    magnitude: torch.Tensor | None = None  # DoRA
    experts: int = 0  # > 0: a 3-D (experts, out, in) tensor, or (experts, in, out) when `in_first`
    in_first: bool = False


def latest_adapter(folder: Path) -> Path:
    """The adapter a run's folder holds: its final adapter, or, when the run stopped before writing
    one (Ctrl-C, a signal, a crash), its newest complete checkpoint, said in one line. Any other
    folder comes back as it is (`read_adapter` says what it lacks)."""
    if not folder.is_dir() or any(os.path.lexists(folder / name) for name in ADAPTER_FILES):
        return folder  # a final adapter, whole or damaged (read_adapter says which)
    newest = ckpt.newest_complete(folder)
    if newest is None and (folder / "lora_tune_config.yaml").is_file():
        raise UserError(
            f"{folder} is a run that stopped before its first checkpoint: it holds no adapter yet. Continue it with the same "
            "`lora-tune train` command plus --resume"
        )
    if newest is None or not all((newest / name).is_file() for name in ADAPTER_FILES):
        return folder
    log.info(
        "%s holds no final adapter (the run stopped at step %d): using its latest complete checkpoint, %s (`train ... --resume` "
        "continues the run)",
        folder,
        ckpt.step_of(newest),
        newest,
    )
    return newest


def tokenizer_folder(adapter_dir: Path, base):
    """The tokenizer training used: saved beside the final adapter, or, for a checkpoint (which holds
    none), in its run's folder; else the base's (`base`, returned as given)."""
    run = adapter_dir.parent if ckpt.is_checkpoint_name(adapter_dir.name) else None
    for folder in (adapter_dir, run):
        if folder is not None and (folder / "tokenizer_config.json").is_file():
            return folder
    return base


def read_adapter(adapter_dir: Path, option: str = "--adapter") -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json (checked field by field) and the weights; `option` names the folder in messages."""
    if not adapter_dir.is_dir():
        raise UserError(f"{option}: {adapter_dir} does not exist; give the --output-dir of a training run")
    config_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise UserError(f"{option}: {adapter_dir} is not an adapter folder (needs adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_bytes())
        weights = load_file(str(weights_path))
    except (ValueError, SafetensorError, OSError) as e:  # ValueError: bad JSON or not UTF-8
        raise UserError(f"{option}: {adapter_dir} is unreadable or truncated ({first_line(e)})") from None
    check_adapter_config(config, config_path, option)
    if not weights:
        raise UserError(f"{option}: {weights_path} is empty (the ZeRO-3 save bug); retrain or re-save the adapter")
    return config, weights


def check_adapter_config(config, path: Path, option: str = "--adapter") -> None:
    """The fields the merge computes with, each of the type and range peft gives it; anything else
    is named in one line before a tensor is read."""

    def bad(what: str) -> UserError:
        return UserError(f"{option}: {path} {what}; it is not a LoRA adapter config peft wrote (fix it or re-save the adapter)")

    def is_number(v, positive: bool = False) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if positive else True)

    if not isinstance(config, dict):
        raise bad(f"holds a JSON {type(config).__name__}, not an object")
    if config.get("peft_type") in OTHER_TYPES:
        return  # merged through peft's own merge_and_unload, which reads its own config
    if config.get("peft_type") != "LORA":
        raise UserError(f"{option}: {path.parent} holds a {config.get('peft_type')} adapter; lora-tune reads LoRA adapters only")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise bad(f"has r = {r!r}; the rank must be a positive integer")
    if "lora_alpha" not in config:
        raise bad("has no lora_alpha (the scale is lora_alpha / r)")
    if not is_number(config["lora_alpha"]):
        raise bad(f"has lora_alpha = {config['lora_alpha']!r}; it must be a number")
    for key, positive in (("rank_pattern", True), ("alpha_pattern", False)):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise bad(f"has {key} = {patterns!r}; it must map module names to numbers")
        for name, value in patterns.items():
            if key == "rank_pattern" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise bad(f"has {key}[{name!r}] = {value!r}; a rank must be a positive integer")
            if not is_number(value, positive):
                raise bad(f"has {key}[{name!r}] = {value!r}; it must be a number")
    for key in ("use_rslora", "fan_in_fan_out", "use_dora"):
        if not isinstance(config.get(key, False), bool):
            raise bad(f"has {key} = {config[key]!r}; it must be true or false")
    targets = config.get("target_parameters")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise bad(f"has target_parameters = {targets!r}; it must be a list of names")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise bad(f"has base_model_name_or_path = {base!r}; it must be a string")


def pattern_value(patterns: dict, module_name: str, default):
    """A rank_pattern / alpha_pattern value for one module, by peft's own matching rule."""
    if not patterns:
        return default
    return patterns.get(get_pattern_key(list(patterns), module_name), default)


def lora_modules(config: dict, weights: dict[str, torch.Tensor]) -> tuple[dict[str, LoraModule], dict[str, torch.Tensor]]:
    """(base weight name -> LoraModule, base weight name -> full replacement for modules_to_save)."""
    prefix = "base_model.model."
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    replacements = {}
    for key, tensor in weights.items():
        name = key.removeprefix(prefix)
        m = re.match(r"(.*)\.(lora_A|lora_B)\.weight$", name) or re.match(r"(.*)\.(lora_magnitude_vector)(?:\.weight)?$", name)
        if m:
            grouped.setdefault(m.group(1), {})[m.group(2)] = tensor
        elif "lora_" not in name:
            replacements[name] = tensor  # modules_to_save: the trained copy replaces the base tensor
    modules = {}
    for module_name, parts in grouped.items():
        if "lora_A" not in parts or "lora_B" not in parts:
            raise UserError(f"--adapter: {module_name} has only {sorted(parts)}; the adapter file is incomplete")
        r = pattern_value(config.get("rank_pattern") or {}, module_name, config["r"])
        alpha = pattern_value(config.get("alpha_pattern") or {}, module_name, config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        modules[f"{module_name}.weight"] = LoraModule(parts["lora_A"], parts["lora_B"], scale, parts.get("lora_magnitude_vector"))
    return modules, replacements


def base_folder(base: str) -> Path:
    """A local folder holding the base's safetensors (downloaded from the hub when an id)."""
    resolved = resolve_base(base)
    path = Path(resolved)
    if not path.is_dir():
        try:
            path = Path(snapshot_download(resolved, allow_patterns=["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja"]))
        except Exception as e:  # noqa: BLE001 - hub errors come in many types
            raise UserError(
                f"--base: could not fetch {resolved} ({first_line(e)}); check the id, your network or HF_TOKEN, or pass a local folder"
            ) from None
    if not list(path.glob("*.safetensors")):
        raise UserError(f"--base: {path} has no .safetensors weights; convert the base to safetensors first")
    return path


@dataclass
class DiskAdapter:
    """The adapter in the base checkpoint's own names: tensors stored as they are loaded (renamed at
    most) by disk name, tensors transformers builds from several disk tensors (fused experts) by
    model name with the layout that converts them."""

    modules: dict[str, LoraModule]  # disk name -> LoRA
    fused: dict[str, LoraModule]  # model name -> LoRA of a converted tensor
    replacements: dict[str, torch.Tensor]  # disk name -> trained copy (modules_to_save)
    transposed: set[str]  # disk names of weights stored (in, out): GPT-2-style Conv1D
    layout: CheckpointLayout | None = None
    rows: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)  # disk name -> (token ids, trained rows)


class NotStreamable(Exception):
    """The adapter can't be merged tensor group by tensor group into this checkpoint (says why)."""


def adapter_tensor(weights: dict[str, torch.Tensor], name: str, part: str) -> torch.Tensor | None:
    return weights.get(f"{name}.{part}.weight", weights.get(f"{name}.{part}"))


def disk_adapter(base: Path, adapter_dir: Path, config: dict, weights: dict[str, torch.Tensor], disk_names, trust_remote_code: bool):
    """The adapter mapped onto the base's tensors on disk: which base tensor each LoRA pair adapts
    is read off peft injecting the adapter's own config into a meta skeleton of the base (nested
    ParamWrappers, rank and alpha patterns, peft's rewrites included, as PeftModel.from_pretrained
    would see them); the disk names come from transformers' conversion mapping. None for a model
    transformers doesn't implement (remote code): its adapter names are taken as the disk names."""
    if config.get("peft_type") in OTHER_TYPES:  # `merge` hands these to peft before asking for LoRA pairs
        raise UserError(
            f"--adapter: {adapter_dir} holds a {config['peft_type']} adapter, not LoRA pairs, which this reads: merge it first "
            "(`lora-tune merge`), then export or serve the merged folder"
        )
    model_config = load_config(str(base), trust_remote_code)
    if model_class(model_config) is None:
        return None
    skeleton = meta_model(model_config)
    layout = CheckpointLayout(skeleton, disk_names)
    modules_of = dict(skeleton.named_modules())
    with torch.device("meta"):
        wrapped = get_peft_model(meta_model(model_config), LoraConfig.from_pretrained(str(adapter_dir)))
    loras: dict[str, LoraModule] = {}
    used = set()
    aliases: dict[int, list[str]] = {}  # a block shared across layers (Zamba) is one LoRA layer under several names
    for name, layer in wrapped.named_modules(remove_duplicate=False):
        if isinstance(layer, LoraLayer):
            aliases.setdefault(id(layer), []).append(name)
    tied = dict(getattr(skeleton, "all_tied_weights_keys", None) or {})  # a tied tensor is stored under its source's name
    for name, layer in lora_layers(wrapped):
        names = aliases[id(layer)]
        keys = [lora_target(n, layer) for n in names]
        key = next((tied.get(k, k) for k in keys if tied.get(k, k) in layout.groups), keys[0])
        module = key.rsplit(".", 1)[0]
        a, b = adapter_tensor(weights, name, "lora_A"), adapter_tensor(weights, name, "lora_B")
        if a is None or b is None:
            raise UserError(f"--adapter: {adapter_dir} has no LoRA weights for {key}; this adapter was trained on another base")
        magnitude = adapter_tensor(weights, name, "lora_magnitude_vector")
        used |= {k for n in names for k in weights if k.startswith(f"{n}.lora_")}
        shape = layout.model_state[key].shape if key in layout.model_state else ()
        experts = shape[0] if len(shape) == 3 else 0
        in_first = bool(getattr(modules_of.get(module), "is_transposed", False))  # transformers' experts stored (E, in, out)
        loras[key] = LoraModule(a, b, layer.scaling["default"], magnitude, experts, in_first)
    leftover = sorted(k for k in set(weights) - used if "lora_" in k)
    if leftover:
        raise UserError(
            f"--adapter: {leftover[0]} (and {len(leftover) - 1} more) adapts nothing in this base; this adapter was trained on another base"
        )
    conv1d = {f"{n}.weight" for n, m in skeleton.named_modules() if isinstance(m, Conv1D)}
    out = DiskAdapter({}, {}, {}, set(), layout)
    for key, lora in loras.items():
        if key not in layout.groups and key in layout.model_state:
            # A model tensor no checkpoint tensor maps to by the conversion mapping alone (a fused
            # qkv that transformers splits on load; names its loader maps otherwise): not one group
            # of its own, so not mergeable tensor group by tensor group.
            raise NotStreamable(f"{key} is not stored as a tensor (group) of its own in the checkpoint")
        if key not in layout.groups:
            raise UserError(f"--base: the adapter targets {key}, which the base does not store; this adapter was trained on another base")
        if layout.is_renaming(key) and not lora.experts:
            disk = layout.groups[key][0]
            out.modules[disk] = lora
            if key in conv1d:
                out.transposed.add(disk)
        else:
            out.fused[key] = lora
    for name, tensor in weights.items():
        key = name.removeprefix("base_model.model.")
        if "lora_" in name:
            continue
        token_rows = re.match(r"(.*)\.token_adapter\.trainable_tokens_delta$", key)
        if token_rows:  # --trainable-tokens: the embedding's trained rows (peft's TrainableTokensLayer)
            key = f"{token_rows.group(1)}.weight"
            if not layout.is_renaming(key):
                raise UserError(f"--adapter: {key} (trainable tokens) is not one tensor in the base; merge can't replace its rows")
            out.rows[layout.groups[key][0]] = (token_indices(config, token_rows.group(1)), tensor)
            continue
        if not layout.is_renaming(key):
            raise UserError(f"--adapter: {key} (modules_to_save) is not stored as one tensor in the base; merge can't replace it")
        out.replacements[layout.groups[key][0]] = tensor
    return out


def token_indices(config: dict, module: str) -> list[int]:
    """The token ids whose rows a trainable-tokens layer on `module` trained: peft's
    trainable_token_indices, a list (the input embedding's) or a mapping from module names."""
    indices = config.get("trainable_token_indices")
    if isinstance(indices, dict):
        indices = indices.get(get_pattern_key(list(indices), module), indices.get(module.rsplit(".", 1)[-1]))
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise UserError(f"--adapter: trainable tokens on {module}, but trainable_token_indices = {indices!r} names no token ids for it")
    return indices


def named_adapter(config: dict, weights: dict[str, torch.Tensor]) -> DiskAdapter:
    """A remote-code model's adapter, by the adapter's own names (no skeleton to map them)."""
    modules, replacements = lora_modules(config, weights)
    transposed = set(modules) if config.get("fan_in_fan_out") else set()
    return DiskAdapter(modules, {}, replacements, transposed)
