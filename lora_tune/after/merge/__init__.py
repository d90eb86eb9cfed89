"""`lora-tune merge`: fold a LoRA adapter into the full-precision base, shard by shard, and prove it.

Streaming: each base shard is opened lazily (safetensors), each tensor is merged in fp32 and cast
once to the output dtype, and output shards are written as soon as they are full. Peak memory is
about one output shard plus one tensor group plus the adapter, never the whole model.

The output keeps the checkpoint's own names and layouts. The adapter names the loaded model's
tensors, which transformers renames or fuses on load for some checkpoints (an image-text wrapper's
`language_model.model.*`, per-expert MoE tensors fused into one 3-D parameter): each adapted tensor
is mapped to the disk tensors it is built from (`checkpoint_layout`, transformers' own conversion
mapping); a fused one is converted on the fly, merged, and converted back, one group at a time.

Arithmetic mirrors peft's own merge (`W + (B @ A) * scale`, DoRA's `m / ||W + s BA|| * (W + s BA)`)
so that an fp32 merge is bit-identical to `merge_and_unload()`.

Everything is written into a hidden temporary folder next to --output and renamed at the end: a
crash, a full disk or a failed verification never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils.other import get_pattern_key
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging as hf_logging

from lora_tune.after.options import MergeConfig
from lora_tune.errors import UserError, first_line, sigterm_stops
from lora_tune.files import pid_alive, remove_tree
from lora_tune.models import shards
from lora_tune.models.aliases import resolve_base
from lora_tune.models.checkpoint_layout import CheckpointLayout
from lora_tune.models.loading import dequantizing, load_config, quant_method
from lora_tune.models.structure import auto_class, meta_model, model_class, text_ids
from lora_tune.models.targets import lora_layers, lora_target
from lora_tune.options import parse_size

log = logging.getLogger("lora_tune")

OUT_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Relative drift (max |merged - reference| / max |reference|) accepted per output dtype: fp32 is
# exact up to summation order; bf16/fp16 carry the rounding of the final cast.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 4e-2}
FULL_CHECK_MAX_PARAMS = 100_000_000  # up to this size, also compare whole-model logits
VERIFY_LAYERS = 16  # LoRA layers checked against peft's own layer, spread over the model


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


# --- inputs --------------------------------------------------------------------------------------
def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if not adapter_dir.is_dir():
        raise UserError(f"--adapter: {adapter_dir} does not exist; give the --output-dir of a training run")
    config_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise UserError(f"--adapter: {adapter_dir} is not an adapter folder (needs adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_bytes())
        weights = load_file(str(weights_path))
    except (ValueError, SafetensorError, OSError) as e:  # ValueError: bad JSON or not UTF-8
        raise UserError(f"--adapter: {adapter_dir} is unreadable or truncated ({first_line(e)})") from None
    check_adapter_config(config, config_path)
    if not weights:
        raise UserError(f"--adapter: {weights_path} is empty (the ZeRO-3 save bug); retrain or re-save the adapter")
    return config, weights


def check_adapter_config(config, path: Path) -> None:
    """The fields the merge computes with, each of the type and range peft gives it; anything else
    is named in one line before a tensor is read."""

    def bad(what: str) -> UserError:
        return UserError(f"--adapter: {path} {what}; it is not a LoRA adapter config peft wrote (fix it or re-save the adapter)")

    def is_number(v, positive: bool = False) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if positive else True)

    if not isinstance(config, dict):
        raise bad(f"holds a JSON {type(config).__name__}, not an object")
    if config.get("peft_type") != "LORA":
        raise UserError(f"--adapter: {path.parent} holds a {config.get('peft_type')} adapter; only LoRA adapters can be merged")
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
        if not layout.is_renaming(key):
            raise UserError(f"--adapter: {key} (modules_to_save) is not stored as one tensor in the base; merge can't replace it")
        out.replacements[layout.groups[key][0]] = tensor
    return out


def named_adapter(config: dict, weights: dict[str, torch.Tensor]) -> DiskAdapter:
    """A remote-code model's adapter, by the adapter's own names (no skeleton to map them)."""
    modules, replacements = lora_modules(config, weights)
    transposed = set(modules) if config.get("fan_in_fan_out") else set()
    return DiskAdapter(modules, {}, replacements, transposed)


# --- the merge arithmetic ----------------------------------------------------------------------------
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


@dataclass
class PlannedTensor:
    name: str
    source: Path  # the base shard it comes from
    shape: list[int]
    dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_output(shards_: list[Path], out_dtype: torch.dtype, max_bytes: int) -> list[list[PlannedTensor]]:
    """Group every base tensor, in order, into output shards of at most max_bytes, from the
    safetensors headers alone (nothing is loaded)."""
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for shard in shards_:
        for name, entry in shards.read_header(shard).items():
            dtype = shards.DTYPES.get(entry.dtype)
            if dtype is None:
                raise UserError(
                    f"--base: {name} in {shard} is stored as {entry.dtype}, which merge does not read; convert the base to bf16/fp16/fp32"
                )
            tensor = PlannedTensor(name, shard, list(entry.shape), out_dtype if dtype.is_floating_point else dtype)
            if groups[-1] and size + tensor.nbytes > max_bytes:
                groups.append([])
                size = 0
            groups[-1].append(tensor)
            size += tensor.nbytes
    return groups


def write_shard(path: Path, planned: list[PlannedTensor], produce) -> None:
    """Write one safetensors file tensor by tensor: the header is known from the plan, so each
    merged tensor goes to disk as soon as it is computed and is then dropped."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in planned:
        header[t.name] = {"dtype": shards.NAMES[t.dtype], "shape": t.shape, "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in planned:
            tensor = produce(t)
            if tensor.dtype != t.dtype or list(tensor.shape) != t.shape:
                raise RuntimeError(f"{t.name}: produced {tensor.dtype} {list(tensor.shape)}, planned {t.dtype} {t.shape}")
            f.write(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().data if tensor.numel() else b"")  # 0-d too


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_index(folder: Path, groups: list[list[PlannedTensor]], names: list[str]) -> None:
    if len(names) == 1:
        return
    weight_map = {t.name: name for group, name in zip(groups, names) for t in group}
    total = sum(t.nbytes for group in groups for t in group)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_side_files(base: Path, adapter_dir: Path, out: Path, dtype: str) -> None:
    """config.json (chosen dtype, no quantization config), generation config, tokenizer files."""
    config = json.loads((base / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if (base / "generation_config.json").is_file():
        shutil.copy2(base / "generation_config.json", out / "generation_config.json")
    # The tokenizer saved beside the adapter is the one training used (chat template included).
    source = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)


# --- verification -----------------------------------------------------------------------------------
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


def verify_expert(base_w: torch.Tensor, merged_w: torch.Tensor, lora: LoraModule) -> float:
    """Expert 0 of a fused tensor: the merged weight vs its unmerged LoRA forward."""
    orient = (lambda w: w.T) if lora.in_first else (lambda w: w)  # noqa: E731 - (out, in) view of either layout
    return verify_layer("", orient(base_w[0]), orient(merged_w[0]), LoraModule(*expert_rows(lora, 0), lora.scale), False)


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


# --- the command ----------------------------------------------------------------------------------
def merge_whole_model(base: Path, adapter_dir: Path, out: Path, cfg: MergeConfig) -> float | None:
    """Through transformers and peft, the whole model in host memory: for a checkpoint that ships
    quantized weights (dequantized by transformers' own loader; written out plain, in --dtype),
    and for a model transformers doesn't implement (remote code) whose adapter adapts fused tensors,
    where no skeleton says which disk tensors they are built from. save_pretrained writes the
    checkpoint's own layout. Checked on the spot: logits of base + adapter vs the merged model.
    Returns the drift."""
    hf_logging.disable_progress_bar()
    dtype = OUT_DTYPE[cfg.dtype]
    config = load_config(str(base), cfg.trust_remote_code)
    model = auto_class(config).from_pretrained(
        base, dtype=dtype, trust_remote_code=cfg.trust_remote_code, quantization_config=dequantizing(config)
    )
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = text_ids(model, (2, 24), seed=0)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        merged = model.merge_and_unload()
        got = merged(input_ids=ids, use_cache=False).logits
    for name, p in merged.named_parameters():
        if p.is_floating_point() and not all_finite(p.data):
            raise UserError(f"merged weight {name} contains NaN/inf; the adapter is broken (check the training metrics)")
    merged.save_pretrained(out, max_shard_size=cfg.max_shard_size)
    drift = relative_drift(got, want)
    log.info("verify: whole-model logits, base + adapter (peft) vs merged: relative drift %.2e", drift)
    if cfg.verify and sum(p.numel() for p in merged.parameters()) <= FULL_CHECK_MAX_PARAMS:
        # What was written, read back: save_pretrained's layout must load as the model it saved.
        del model, merged
        reloaded = auto_class(config).from_pretrained(out, dtype=dtype, trust_remote_code=cfg.trust_remote_code).eval()
        with torch.no_grad():
            drift = max(drift, relative_drift(reloaded(input_ids=ids, use_cache=False).logits, want))
        log.info("verify: the written folder read back vs base + adapter (peft): relative drift %.2e", drift)
    return drift if cfg.verify else None


def check_apart(out: Path, folder: Path, what: str) -> None:
    """--output is never the adapter's or the base's folder, nor inside one, nor around one: the
    merge (with --overwrite, the swap) would delete its own input. --overwrite does not change that."""
    out_r, folder_r = out.resolve(), folder.resolve()
    if out_r == folder_r:
        relation = "is"
    elif folder_r in out_r.parents:
        relation = "is inside"
    elif out_r in folder_r.parents:
        relation = "contains"
    else:
        return
    raise UserError(
        f"--output: {out} {relation} the {what} folder {folder}; merge never writes there, --overwrite or not (it would destroy "
        "its own input). Choose another --output"
    )


def prepare_output(out: Path, overwrite: bool) -> None:
    """Refuses an --output that can't be written or would replace something without --overwrite;
    removes the temporary folders that a merge killed outright (SIGKILL) left beside it."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == out and not out.is_dir():
        raise UserError(f"--output: {out} is a file; give a folder")
    if not existing.is_dir():
        raise UserError(f"--output: {out} would be inside {existing}, which is a file; give a folder")
    parent = out.parent if out.parent.exists() else existing
    if os.statvfs(parent).f_flag & os.ST_RDONLY or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--output: {parent} can't be written (read-only or no permission); choose another --output")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--output: {out} is not empty; choose another folder or pass --overwrite")
    if out.parent.is_dir():
        for left in out.parent.glob(f".{out.name}.*-*"):
            kind, _, pid = left.name.removeprefix(f".{out.name}.").partition("-")
            if kind in ("tmp", "old") and pid.isdigit() and not pid_alive(pid):
                log.info("removing %s, left by a merge that was killed", left)
                remove_tree(left)


def run(cfg: MergeConfig) -> Path:
    adapter_dir = Path(cfg.adapter).expanduser()
    out = Path(cfg.output).expanduser()
    max_bytes = parse_size(cfg.max_shard_size, "--max-shard-size")
    check_apart(out, adapter_dir, "adapter")
    config, weights = read_adapter(adapter_dir)
    base_ref = cfg.base or config.get("base_model_name_or_path")
    if not base_ref:
        raise UserError(f"--base: {adapter_dir}/adapter_config.json records no base; pass --base")
    base = base_folder(base_ref)
    check_apart(out, base, "base model")
    prepare_output(out, cfg.overwrite)
    dtype = OUT_DTYPE[cfg.dtype]
    base_files = shards.weight_files(base)

    def through_transformers(reason: str, n_bytes: int) -> Path:
        """The whole-model route (transformers + peft, verified), said with its memory."""
        log.warning("merge: %s; merging through transformers with the whole model in host memory (~%.1f GB)", reason, n_bytes / 1e9)
        return finish(out, lambda tmp: merge_whole_model(base, adapter_dir, tmp, cfg), base, adapter_dir, cfg)

    quantized = quant_method(load_config(str(base), cfg.trust_remote_code))
    if quantized:
        stored = sum(e.nbytes for f in base_files for e in shards.read_header(f).values())
        reason = f"{base} ships {quantized}-quantized weights, which transformers dequantizes (more than stored) into plain {cfg.dtype}"
        return through_transformers(reason, stored)
    groups = plan_output(base_files, dtype, max_bytes)
    sources = {t.name: t.source for group in groups for t in group}
    output_bytes = sum(math.prod(t.shape) for group in groups for t in group) * dtype.itemsize
    try:
        adapter = disk_adapter(base, adapter_dir, config, weights, sources, cfg.trust_remote_code)
    except NotStreamable as e:
        return through_transformers(f"{e}, so transformers writes the checkpoint's own layout", output_bytes)
    if adapter is None and config.get("target_parameters"):
        reason = (
            f"the adapter adapts {', '.join(config['target_parameters'])} of a model transformers doesn't implement (remote code), "
            "so which tensors on disk they are built from is unknown"
        )
        return through_transformers(reason, output_bytes)
    if adapter is None:
        adapter = named_adapter(config, weights)
        missing = sorted((set(adapter.modules) | set(adapter.replacements)) - set(sources))
        if missing:
            raise UserError(
                f"--base: the adapter targets {missing[0]} (and {len(missing) - 1} more) which the base does not have; this "
                "adapter was trained on another base"
            )
    n_loras = len(adapter.modules) + len(adapter.fused)

    def stream(tmp: Path) -> float | None:
        t0 = time.perf_counter()
        merger = TensorMerger(adapter, dtype, cfg.verify, sources)
        names = shard_names(len(groups))
        for group, name in zip(groups, names):
            write_shard(tmp / name, group, merger)
        merger.close()
        write_index(tmp, groups, names)
        total = sum(t.nbytes for group in groups for t in group)
        log.info("wrote %d shard(s), %.2f GB, %d LoRA modules merged in %.1fs", len(names), total / 1e9, n_loras, time.perf_counter() - t0)
        if not cfg.verify:
            return None
        drift = max(merger.layer_drifts, default=0.0)
        log.info("verify: %d sampled layers vs the unmerged LoRA forward: max relative drift %.2e", len(merger.layer_drifts), drift)
        if sum(math.prod(t.shape) for group in groups for t in group) <= FULL_CHECK_MAX_PARAMS:
            logits_drift = verify_logits(base, adapter_dir, tmp, cfg.trust_remote_code)
            log.info("verify: whole-model logits vs base + adapter (peft): relative drift %.2e", logits_drift)
            drift = max(drift, logits_drift)
        return drift

    return finish(out, stream, base, adapter_dir, cfg)


def finish(out: Path, write, base: Path, adapter_dir: Path, cfg: MergeConfig) -> Path:
    """Run `write(tmp)` (-> drift, or None when not verified) into a hidden temporary folder, add
    the side files, check the drift, and only then put the folder in place."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    with sigterm_stops(f"merging into {out}", "nothing was written. Run the same command again"):
        return _finish(out, tmp, write, base, adapter_dir, cfg)


def _finish(out: Path, tmp: Path, write, base: Path, adapter_dir: Path, cfg: MergeConfig) -> Path:
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    try:
        write_side_files(base, adapter_dir, tmp, cfg.dtype)  # first: verification loads the folder
        drift = write(tmp)
        if drift is not None:
            tolerance = TOLERANCE[cfg.dtype]
            if not drift <= tolerance:
                raise UserError(
                    f"verification failed: merged model drifts {drift:.2e} from base + adapter (tolerance {tolerance:.0e}); "
                    "nothing was written"
                )
            log.info("verified: drift %.2e within tolerance %.0e for %s", drift, tolerance, cfg.dtype)
        if out.exists():  # --overwrite: swap, so the old folder is only gone once the new one is in place
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            remove_tree(old)
        else:
            os.replace(tmp, out)
    except OSError as e:
        remove_tree(tmp)
        raise UserError(
            f"--output: could not write the merged model under {out.parent} ({e.strerror or e}); nothing was left behind. Free "
            "space or choose another --output",
            exit_code=1,
        ) from None
    except BaseException:
        remove_tree(tmp)
        raise
    log.info("merged model written to %s", out)
    return out
