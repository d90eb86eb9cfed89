"""The shapes of a model, read off a meta-device skeleton of its config.json: no weights, no memory,
any family transformers implements (fused projections, Conv1D, tied embeddings, MoE experts all
counted exactly, as stored)."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from huggingface_hub import hf_hub_download
from transformers import AutoConfig

from lora_tune.errors import UserError, first_line
from lora_tune.models.aliases import ALIASES, architecture, looks_like_path, resolve_base
from lora_tune.models.structure import block_modules, linear_name, meta_model, recurrent_layers
from lora_tune.models.targets import ROUTERS, Inventory, block_path, is_plain_linear, peft_accepted, resolve_targets
from lora_tune.planner.records import VisionTower
from lora_tune.planner.vision import read_tower


@dataclass(frozen=True)
class Architecture:
    """The shapes of a causal LM, read off a meta-device skeleton of its config (no weights, no
    memory): every family transformers implements, counted exactly, whatever it fuses, ties,
    shares or spreads over experts."""

    model_type: str
    hidden: int
    intermediate: int  # MLP width (per expert for MoE)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool  # SwiGLU/GeGLU MLP (gate, up, product) or a plain one (fc, activation)
    experts: int  # 0: dense
    active_experts: int  # experts per token (MoE)
    linears: tuple[tuple[str, int, int], ...]  # (short name, in, out) of every linear layer in the blocks
    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # (path in a block, shape): fused expert tensors, routers
    inventory: Inventory
    total: int  # every parameter
    other_params: int  # of the language model and head, not in a block's linear weight: embeddings, norms, biases, experts, routers
    quantized: str | None = None  # the quant_method of a checkpoint that ships quantized weights (fp8, mxfp4)
    recurrent: int = 0  # layers with a recurrent/convolution state (linear attention, SSM) instead of attention
    vision: VisionTower | None = None  # an image-text model's vision tower and projector (lora_tune.planner.vision)
    # The transformers config the shapes were read from: what train's own checks ask of the model
    # (sequence parallelism), so the plan recommends only what train accepts.
    config: object = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, c: dict) -> Architecture:
        return _architecture(json.dumps(c, sort_keys=True, default=str))

    @property
    def expert_params(self) -> int:
        """Parameters in fused 3-D expert tensors (bitsandbytes leaves them unquantized)."""
        return sum(math.prod(shape) for path, shape in self.tensors if path in self.inventory.experts)


@functools.lru_cache(maxsize=16)
def _architecture(config_json: str) -> Architecture:
    c = json.loads(config_json)
    model_type = c.get("model_type")
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in c.items() if k != "model_type"})
        skeleton = meta_model(config)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"--base: transformers can't build model_type {model_type!r} from this config.json ({first_line(e)[:120]}); "
            "only causal LMs that transformers implements (no remote code) can be planned"
        ) from None
    # The language model's blocks only: an image-text wrapper's vision tower is counted in `total`
    # and in `vision`, adapted only with --train-vision.
    linears, tensors = [], []
    for name, m in block_modules(skeleton):
        if is_plain_linear(m):
            # Conv1D (GPT-2) stores its weight (in, out)
            n_in, n_out = (m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else tuple(m.weight.shape)
            linears.append((linear_name(name), int(n_in), int(n_out)))
            continue
        tensors += [(block_path(f"{name}.{p}"), tuple(t.shape)) for p, t in m.named_parameters(recurse=False) if t.dim() >= 2]
    total = sum(p.numel() for p in skeleton.parameters())
    names = {n for n, _, _ in linears}
    text = config.get_text_config(decoder=True)  # the language model's shapes (of an image-text wrapper too)

    def get(*keys):
        """The first of these sizes the config has; per-layer ones (a list, or a config that refuses a
        global read: Gemma 4's head_dim) as their largest value."""
        for key in keys:
            try:
                value = getattr(text, key, None)
            except Exception:  # noqa: BLE001 - transformers raises its own error for per-layer attributes
                layers = text.per_layer_config
                value = max(getattr(layers[i], key, 0) or 0 for i in range(len(layers)))
            if isinstance(value, (list, tuple)):
                value = max(value) if value and all(isinstance(v, int) for v in value) else None
            if value:
                return value
        return None

    hidden = get("hidden_size", "d_model", "n_embd")
    if not hidden:
        raise UserError(
            f"--base: {model_type} has no hidden size in its config; the planner models decoders of hidden-size wide layers only"
        )
    heads = get("num_attention_heads", "n_head") or 0  # 0: no attention at all (Mamba)
    inventory = peft_adaptable(config, Inventory.of(skeleton))
    vision = read_tower(config, skeleton)  # last: it replaces the skeleton's linear layers with bitsandbytes'
    return Architecture(
        model_type=model_type,
        hidden=hidden,
        intermediate=get("moe_intermediate_size", "intermediate_size", "n_inner") or 4 * hidden,
        layers=get("num_hidden_layers", "n_layer", "num_layers"),
        heads=heads,
        kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or (hidden // heads if heads else 0),
        vocab=text.vocab_size,
        gated=bool(names & {"gate_proj", "gate_up_proj", "w1"}) or any("gate_up" in t for t, _ in tensors),
        experts=get("num_local_experts", "num_experts", "n_routed_experts") or 0,
        active_experts=get("num_experts_per_tok") or 1,
        linears=tuple(linears),
        tensors=tuple(tensors),
        inventory=inventory,
        total=total,
        other_params=total - sum(a * b for _, a, b in linears) - (vision.params if vision else 0),
        quantized=(c.get("quantization_config") or {}).get("quant_method"),
        recurrent=recurrent_layers(config),
        vision=vision,
        config=config,
    )


# LoRA options that don't change which layers peft accepts: for probing which of them it does.
PROBE_OPTIONS = SimpleNamespace(rank=8, lora_alpha=16, dropout=0.0, dora=False, rslora=False, target_modules=None)


def peft_adaptable(config, inventory: Inventory) -> Inventory:
    """The inventory without the linear layers peft refuses to adapt on this model (Mamba's in/out
    projections): train leaves them out of the default targets too (`adapter.peft_accepted`)."""
    try:
        accepted = peft_accepted(config, PROBE_OPTIONS, resolve_targets(inventory, PROBE_OPTIONS)).modules
    except UserError:  # no linear layers at all: nothing to leave out
        return inventory
    return replace(inventory, linears=tuple(n for n in inventory.linears if n in accepted or n in ROUTERS))


def load_architecture(base: str) -> Architecture:
    """Of an alias (its shipped config.json), a local model folder, or a hub id (its config.json)."""
    if base in ALIASES:
        return Architecture.from_config(architecture(base))
    if looks_like_path(base):
        path = Path(base).expanduser() / "config.json"
        if not path.is_file():
            raise UserError(f"--base: {path} does not exist; give a model folder with a config.json, or an alias from `lora-tune models`")
        return Architecture.from_config(read_config_json(path))
    resolved = resolve_base(base)  # unknown aliases fail here, with a suggestion
    try:
        return Architecture.from_config(json.loads(Path(hf_hub_download(resolved, "config.json")).read_text()))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise UserError(f"--base: could not read config.json of {resolved} ({first_line(e)}); pass an alias or a local folder") from None


def read_config_json(path: Path) -> dict:
    """A model folder's config.json, validated: one error line when it is unreadable or not a JSON
    object. Non-finite floats, which transformers writes as {"__float__": "Infinity"} (Mamba-2
    hybrids' time_step_limit), are decoded as transformers decodes them."""

    def non_finite(obj: dict):
        return float(obj["__float__"]) if obj.keys() == {"__float__"} and isinstance(obj["__float__"], str) else obj

    try:
        config = json.loads(path.read_bytes(), object_hook=non_finite)
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8, or a "__float__" that isn't one
        raise UserError(f"--base: {path} is unreadable or not JSON ({first_line(e)}); restore it from the model's source") from None
    if not isinstance(config, dict):
        raise UserError(f"--base: {path} is not a model config (a JSON object); restore it from the model's source")
    return config
