"""What LoRA adapts on this model: --target-modules resolved against the model's own linears, fused
expert tensors and routers (on a meta skeleton before loading, so a bad name fails first), and put
in a form peft adapts exactly as asked and loads back."""

from __future__ import annotations

import copy
import logging
import re
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import bitsandbytes as bnb
import peft
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.adalora import AdaLoraLayer
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import get_pattern_key
from transformers.pytorch_utils import Conv1D

from lora_tune.errors import UserError, first_line
from lora_tune.models.checkpoint_layout import natural_order
from lora_tune.models.loading import unquantized_experts
from lora_tune.models.structure import (
    anchored_pattern,
    block_modules,
    body_path,
    is_image_text,
    linear_name,
    meta_model,
    model_class,
    multimodal_body,
    vision_parts,
)

if TYPE_CHECKING:
    from lora_tune.config import TrainConfig

log = logging.getLogger("lora_tune")


# Routers pick experts; adapting them changes which experts see a token, which LoRA recipes for MoE
# models (Mixtral, Qwen-MoE) leave alone: out of the default, allowed by name.
ROUTERS = ("gate", "router", "shared_expert_gate")


def is_linear(module) -> bool:
    """nn.Linear (bitsandbytes' 8/4-bit layers subclass it) or GPT-2's Conv1D (a transposed linear)."""
    return isinstance(module, (torch.nn.Linear, Conv1D))


def is_plain_linear(module) -> bool:
    """A linear layer that computes x W^T + b, which is what a LoRA pair beside it adds to. An
    nn.Linear subclass with a forward of its own counts when it maps inputs of any leading shape to
    out_features, as a linear does (Falcon's FalconLinear), checked on the meta device; one that
    reshapes its input into groups (DeepSeek-V4's grouped output projection) doesn't."""
    if isinstance(module, (Conv1D, bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)):  # bitsandbytes: the same product, quantized
        return True
    if not isinstance(module, torch.nn.Linear):
        return False
    return type(module).forward is torch.nn.Linear.forward or maps_like_a_linear(module)


def maps_like_a_linear(module: torch.nn.Linear) -> bool:
    # A shallow copy whose tensors are meta tensors of the same shapes: no memory, whatever the
    # module's own device. Leading dims 5 x 7 (primes) so that no grouping of them goes unnoticed.
    clone = copy.copy(module)
    params = module._parameters.items()
    clone._parameters = {k: None if v is None else torch.nn.Parameter(v.to("meta"), requires_grad=False) for k, v in params}
    clone._buffers = {k: None if v is None else v.to("meta") for k, v in module._buffers.items()}
    try:
        with torch.no_grad():
            out = clone(torch.empty(5, 7, module.in_features, device="meta"))
    except Exception:  # noqa: BLE001 - a forward that can't take a plain input is not a plain linear
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (5, 7, module.out_features)  # Llama 4's router returns a tuple


def block_path(name: str) -> str:
    """`model.layers.3.mlp.experts` -> `mlp.experts`: the path inside a block."""
    parts = name.split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[digits[0] + 1 :]) if digits else name


@dataclass(frozen=True)
class Targets:
    """What LoRA adapts: linear modules by short name, and tensors adapted as peft target_parameters
    (fused experts, a router, or linears peft would otherwise rewrite away) by their path inside a
    block. `scope`: the decoder body's path when the short names also name modules outside its
    blocks (an image-text wrapper's vision tower, a head's transform): peft then gets a pattern
    anchored there instead of the names."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = ()
    scope: str | None = None
    vision: tuple[str, ...] = ()  # --train-vision: the vision tower's and projector's paths, where `modules` adapt too
    tokens: tuple[int, ...] = ()  # --trainable-tokens: the embedding rows trained (token ids)

    def peft_target_modules(self) -> list[str] | str:
        """What peft's LoraConfig(target_modules=...) takes (and adapter_config.json records)."""
        if self.scope is None or not self.modules:
            return list(self.modules)
        return anchored_pattern(self.scope, self.modules, self.vision)

    def weights(self, model) -> set[str]:
        """The names of the base tensors these targets adapt in `model` (unwrapped)."""
        names = {f"{name}.weight" for name, _ in self.vision_linears(model)}
        for name, module in block_modules(model):
            if is_linear(module) and linear_name(name) in self.modules:
                names.add(f"{name}.weight")
            for p, _ in module.named_parameters(recurse=False):
                if block_path(f"{name}.{p}") in self.parameters or f"{name}.{p}" in self.parameters:
                    names.add(f"{name}.{p}")
        return names

    def vision_linears(self, model) -> list[tuple[str, torch.nn.Module]]:
        """--train-vision: (name, module) of the vision tower's and projector's linears adapted."""
        return [
            (name, module)
            for root in self.vision
            for name, module in model.get_submodule(root).named_modules(prefix=root)
            if is_plain_linear(module) and linear_name(name) in self.modules
        ]

    def describe(self, model) -> str:
        counts: dict[str, int] = {}
        vision = {f"{name}.weight" for name, _ in self.vision_linears(model)}
        for name in sorted(self.weights(model), key=natural_order):
            path = block_path(name)
            key = path if path in self.parameters else linear_name(path.removesuffix(".weight"))
            key = f"vision {linear_name(name.removesuffix('.weight'))}" if name in vision else key
            counts[key] = counts.get(key, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in counts.items())


def is_experts(module) -> bool:
    """A module holding MoE experts as stacked matrices (experts, out, in): what transformers'
    experts decorator marks (`is_transposed`), or a module whose parameters are all such stacks of
    one expert count (Llama 4, JetMoE). Not a convolution's kernel, a Mamba mixer's per-head
    tensors or an attention's per-head projections, which sit beside other parameters."""
    params = [t for _, t in module.named_parameters(recurse=False)]
    stacks = [t for t in params if t.dim() == 3 and min(t.shape) > 1]
    if not stacks or isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
        return False
    return hasattr(module, "is_transposed") or (len(stacks) == len(params) and len({t.shape[0] for t in stacks}) == 1)


@dataclass(frozen=True)
class Inventory:
    """What a model's language model offers LoRA, by name: linear layers in the decoder body's blocks
    (short names), fused expert tensors (3-D parameters of modules that are not convolutions) and
    non-linear routers (paths inside a block). Taken from the real model or from a meta skeleton
    (the planner), so both resolve --target-modules by the same rules. `body`: the decoder body's
    path; `elsewhere`: short names of the modules outside its blocks (vision towers, heads)."""

    linears: tuple[str, ...]
    experts: tuple[str, ...]
    routers: tuple[str, ...]
    body: str = "model"
    elsewhere: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()  # linears whose weight is one tensor with another layer's (Zamba's shared block)
    vision: tuple[str, ...] = ()  # paths of the vision tower and projector (structure.vision_parts)
    vision_linears: tuple[str, ...] = ()  # short names of their plain linear layers (--train-vision's targets)

    @classmethod
    def of(cls, model) -> Inventory:
        blocks = dict(block_modules(model))
        linears = {linear_name(n) for n, m in blocks.items() if is_plain_linear(m)}
        experts = {
            block_path(f"{n}.{p}") for n, m in blocks.items() if is_experts(m) for p, t in m.named_parameters(recurse=False) if t.dim() == 3
        }
        routers = {block_path(n) for n, m in blocks.items() if n.rsplit(".", 1)[-1] in ROUTERS and not is_linear(m)}
        # What a target name would also match (peft: the name, or a dotted suffix of it)
        others = [n.split(".") for n, m in model.named_modules() if n and (n not in blocks or not is_plain_linear(m))]
        elsewhere = {".".join(parts[-k:]) for parts in others for k in (1, 2, 3) if k <= len(parts)}
        tied_weights = {k for pair in (getattr(model, "all_tied_weights_keys", None) or {}).items() for k in pair}
        tied = {linear_name(n) for n, m in blocks.items() if is_linear(m) and f"{n}.weight" in tied_weights}
        vision = vision_parts(model) if is_image_text(model.config) else []
        vision_linears = {linear_name(n) for path, part in vision for n, m in part.named_modules(prefix=path) if is_plain_linear(m)}
        return cls(
            tuple(sorted(linears)),
            tuple(sorted(experts)),
            tuple(sorted(routers)),
            body_path(model),
            tuple(sorted(elsewhere)),
            tuple(sorted(tied)),
            tuple(path for path, _ in vision),
            tuple(sorted(vision_linears)),
        )


def resolve_targets(model_or_inventory, cfg) -> Targets:
    """--target-modules checked against the model (a meta skeleton does): each name is a linear
    module (short name), a fused expert tensor (its name, or `experts` for all of them), or a
    router. Default: every linear layer of the transformer blocks (fused qkv_proj / gate_up_proj /
    c_attn kept whole), never lm_head or anything outside the blocks, the MoE routers left out, and
    MoE experts included: per-expert linears by name, fused expert tensors as target parameters."""
    inv = model_or_inventory if isinstance(model_or_inventory, Inventory) else Inventory.of(model_or_inventory)
    train_vision = getattr(cfg, "train_vision", False)
    if train_vision and not inv.vision:
        raise UserError("--train-vision: this model has no vision tower or projector apart from its language model; leave it out")
    vision_names = inv.vision_linears if train_vision else ()
    if not cfg.target_modules:
        names = [n for n in inv.linears if n not in ROUTERS and n not in inv.tied]
        names += [n for n in vision_names if n not in names]
        if not names:
            raise UserError(
                "--target-modules: no linear layers found inside the transformer blocks of this model; pass --target-modules explicitly"
            )
        targets = Targets(tuple(names), inv.experts)
    else:
        modules, parameters = [], []
        for name in cfg.target_modules:
            experts = [e for e in inv.experts if name in ("experts", e.rsplit(".", 1)[-1])]
            routers = [f"{r}.weight" for r in inv.routers if r.rsplit(".", 1)[-1] == name]  # a router as a parameter (peft ParamWrapper)
            if name in inv.tied:
                raise UserError(
                    f"--target-modules: {name} shares its weight with another layer's (tied: one tensor in the checkpoint), so "
                    "LoRA on it could not be merged; leave it out"
                )
            if name in inv.linears or name in vision_names:
                modules.append(name)
            elif experts or routers:
                parameters += experts + routers
            elif name in inv.vision_linears:
                raise UserError(
                    f"--target-modules: {name} is a layer of the vision tower / projector, which trains frozen; pass --train-vision "
                    "to adapt it"
                )
            else:
                choices = " ".join(
                    list(dict.fromkeys(list(inv.linears) + list(vision_names)))
                    + (["experts"] if inv.experts else [])
                    + sorted({r.rsplit(".", 1)[-1] for r in inv.routers})
                )
                raise UserError(f"--target-modules: {name} is not a linear layer or expert tensor of this model; choose from: {choices}")
        targets = Targets(tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(parameters)))
    if train_vision:
        targets = Targets(targets.modules, targets.parameters, scope=inv.body, vision=inv.vision)
    elif set(targets.modules) & set(inv.elsewhere):
        targets = Targets(targets.modules, targets.parameters, scope=inv.body)
    check_parameter_options(targets, cfg)
    return targets


def check_parameter_options(targets: Targets, cfg) -> None:
    """peft adapts target_parameters without dropout, DoRA or a weight-based init: refused in one line."""
    if targets.parameters and getattr(cfg, "dropout", 0):
        raise UserError(
            f"--dropout {cfg.dropout}: LoRA on {', '.join(targets.parameters)} (fused expert/router tensors, peft's target_parameters) "
            "works only without dropout; pass --dropout 0, or leave them out with --target-modules " + " ".join(targets.modules)
        )
    init = getattr(cfg, "init_lora_weights", None)
    if targets.parameters and init not in (None, "gaussian"):
        raise UserError(
            f"--init-lora-weights {init}: peft's init works on a linear layer's weight, and fused expert/router tensors "
            f"({', '.join(targets.parameters)}) are not one; use gaussian, or leave them out with --target-modules "
            + " ".join(targets.modules)
        )
    if targets.parameters and getattr(cfg, "dora", False):
        raise UserError(
            f"--dora: peft has no DoRA for fused expert/router tensors ({', '.join(targets.parameters)}); leave out --dora or "
            "pass --target-modules " + " ".join(targets.modules)
        )


def base_name(name: str) -> str:
    """The base model's name of a peft-wrapped model's parameter or module: peft's prefixes and
    `.base_layer` wrappers dropped (nested ones too: fused experts get one per adapted parameter)."""
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", name.removeprefix("peft_model.").removeprefix("base_model.model."))


def lora_target(name: str, layer) -> str:
    """The base tensor a LoRA layer (peft module `name`) adapts: a linear's weight, or the parameter
    a ParamWrapper names."""
    return f"{base_name(name)}.{getattr(layer, 'parameter_name', 'weight')}"


def adapted_weights(peft_model) -> dict[str, int]:
    """What peft really adapted: base tensor name -> LoRA rank (nested ParamWrappers, one per
    tensor of a module, each name their own parameter)."""
    return {lora_target(name, layer): layer.r["default"] for name, layer in lora_layers(peft_model)}


def expected_ranks(wanted: set[str], cfg) -> dict[str, int]:
    """The base tensors asked for, each at the rank asked for: --layers-to-transform keeps those of
    the listed decoder layers (the first index in a name), --rank-pattern sets a module's rank by
    the first pattern that matches it as peft matches them (its full name or a dotted suffix)."""
    patterns = getattr(cfg, "rank_patterns", None) or {}
    layers = set(getattr(cfg, "layers_to_transform", None) or ())
    expected = {}
    for name in wanted:
        module = name.rsplit(".", 1)[0]
        index = re.search(r"\.(\d+)(?:\.|$)", module)
        if layers and (index is None or int(index.group(1)) not in layers):
            continue
        expected[name] = patterns.get(get_pattern_key(list(patterns), module), cfg.rank) if patterns else cfg.rank
    return expected


def adaptation_mismatch(expected: dict[str, int], adapted: dict[str, int]) -> str | None:
    """How what peft adapted differs from the base tensors asked for at their ranks, or None."""
    if adapted == expected:
        return None
    left_out = sorted(set(expected) - set(adapted))
    added = sorted(set(adapted) - set(expected))
    ranks = sorted(k for k in set(expected) & set(adapted) if adapted[k] != expected[k])
    parts = [f"{len(left_out)} left out (e.g. {left_out[0]})"] if left_out else []
    parts += [f"{len(added)} added (e.g. {added[0]})"] if added else []
    parts += [f"{len(ranks)} at rank {adapted[ranks[0]]} instead of {expected[ranks[0]]} (e.g. {ranks[0]})"] if ranks else []
    return ", ".join(parts)


class PeftRefused(Exception):
    """peft raised while injecting the targets (the message is its first line)."""


class PeftOnMeta:
    """peft injecting LoRA into meta skeletons of one model (shapes only, no memory) the way training
    will, each set of targets once: resolving the default targets, the exact-targets rewrite and the
    load-back check all ask it, so checking a run builds one skeleton per set of targets tried (one,
    mostly) instead of one per question."""

    def __init__(self, config, cfg):
        self.config, self.cfg = config, cfg
        self.injected: dict[Targets, tuple[set[str], dict[str, int], object] | PeftRefused] = {}

    def inject(self, targets: Targets) -> tuple[set[str], dict[str, int]]:
        """(the tensors asked for, what peft adapted: name -> rank). Raises PeftRefused."""
        if targets not in self.injected:
            skeleton = meta_model(self.config)
            wanted = targets.weights(skeleton)
            try:
                with torch.device("meta"):
                    peft_model = get_peft_model(skeleton, lora_config(self.cfg, targets))
                self.injected[targets] = (wanted, adapted_weights(peft_model), peft_model)
            except (ValueError, TypeError, RuntimeError, KeyError) as e:
                self.injected[targets] = PeftRefused(first_line(e))
        found = self.injected[targets]
        if isinstance(found, PeftRefused):
            raise found
        return found[0], found[1]

    def model(self, targets: Targets):
        """The meta peft model of these targets (injected once)."""
        self.inject(targets)
        return self.injected[targets][2]


def inject_on_meta(config, cfg, targets: Targets) -> tuple[set[str], dict[str, int]]:
    """Inject the targets into a meta skeleton of `config` (no memory) the way training will: (the
    tensors asked for, what peft adapted). Raises PeftRefused."""
    return PeftOnMeta(config, cfg).inject(targets)


def probe_peft(meta: PeftOnMeta, targets: Targets) -> tuple[set[str], dict[str, int]]:
    """meta.inject, peft refusing the targets being one error line."""
    try:
        return meta.inject(targets)
    except PeftRefused as e:
        names = ", ".join(targets.modules + targets.parameters)
        raise UserError(f"--target-modules: peft can't adapt {names} on this model ({e})") from None


def peft_exact_targets(config, cfg, targets: Targets, meta: PeftOnMeta | None = None) -> Targets:
    """The targets in a form peft adapts exactly as asked. peft 0.21 rewrites the targets of model
    types whose checkpoints transformers fuses (MoE): it drops gate/up/down_proj from target_modules
    (so dense first layers and shared experts get no LoRA) and doubles the rank of fused gate_up
    experts. Linears named in target_parameters by their block path are left alone (and load back
    with stock peft); whatever still differs is refused in one line, before loading. Default
    targets that peft refuses to adapt (Mamba's in/out projections) are left out, and said so."""
    meta = meta or PeftOnMeta(config, cfg)
    if not cfg.target_modules:
        targets = peft_accepted(config, cfg, targets, meta)
    wanted, adapted = probe_peft(meta, targets)
    mismatch = adaptation_mismatch(expected_ranks(wanted, cfg), adapted)
    if mismatch is None:
        return targets
    dropped = {linear_name(n.removesuffix(".weight")) for n in wanted - set(adapted)} & set(targets.modules)
    if dropped:
        # By block path; by full name when a scope is set, since the same block paths name the vision
        # tower's layers too (target_parameters match name suffixes, not an anchored pattern).
        linears = [n for n in wanted if n.endswith(".weight") and linear_name(n.removesuffix(".weight")) in dropped]
        moved = tuple(sorted({n if targets.scope else block_path(n) for n in linears} - set(targets.parameters), key=natural_order))
        modules = tuple(m for m in targets.modules if m not in dropped)
        candidate = replace(targets, modules=modules, parameters=targets.parameters + moved, scope=targets.scope if modules else None)
        candidate_wanted, candidate_adapted = probe_peft(meta, candidate)
        if adaptation_mismatch(expected_ranks(candidate_wanted, cfg), candidate_adapted) is None:
            if cfg.precision in ("8bit", "4bit"):
                raise UserError(
                    f"--precision {cfg.precision}: peft rewrites the LoRA targets of {config.model_type} models ({mismatch}); the way "
                    f"around it, adapting {', '.join(sorted(dropped))} as target_parameters, needs unquantized weights: use --precision "
                    "bf16, or pass --target-modules without them"
                )
            check_parameter_options(candidate, cfg)
            log.info(
                "peft rewrites the LoRA targets of %s models (%s): %s adapted as target_parameters instead",
                config.model_type,
                mismatch,
                ", ".join(sorted(dropped)),
            )
            return candidate
    raise UserError(
        f"--target-modules: peft would not adapt this {config.model_type} model as asked ({mismatch}); pass --target-modules "
        "with the linear layers to adapt"
    )


def peft_accepted(config, cfg, targets: Targets, meta: PeftOnMeta | None = None) -> Targets:
    """The default targets without the linear layers peft refuses to adapt on this model (each
    tried alone on a meta skeleton when all of them together are refused), logged."""
    meta = meta or PeftOnMeta(config, cfg)
    try:
        meta.inject(targets)
        return targets
    except PeftRefused:
        pass
    refused = {}
    for name in targets.modules:
        try:
            meta.inject(replace(targets, modules=(name,), parameters=()))
        except PeftRefused as e:
            refused[name] = str(e)
    if not refused or len(refused) == len(targets.modules):
        return targets  # refused as a whole (or for no one module): probe_peft says why
    for name, why in refused.items():
        log.warning("LoRA targets: %s left out, peft refuses to adapt it on this model (%s)", name, why)
    return replace(targets, modules=tuple(m for m in targets.modules if m not in refused))


def check_loads_back(config, cfg, targets: Targets, meta: PeftOnMeta | None = None) -> None:
    """Refuse, before loading, an adapter stock peft could not load back onto this model: peft
    0.21 renames adapter keys with transformers' conversion mapping on load, and for a few model
    types the patterns also match the names the model already uses (Laguna's `shared_expert.`
    matches `shared_experts.`), so PeftModel.from_pretrained, resume and eval would silently drop
    those LoRA tensors. Tried on the meta skeleton the targets were injected into: the adapter's own
    state dict loaded back (into the same structure a fresh PeftModel.from_pretrained builds)."""
    peft_model = (meta or PeftOnMeta(config, cfg)).model(targets)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns about the keys it drops: counted here instead
        state = get_peft_model_state_dict(peft_model)
        result = set_peft_model_state_dict(peft_model, state)
    dropped = sorted(k for k in result.unexpected_keys if "lora_" in k)
    if dropped:
        raise UserError(
            f"--base: peft {peft.__version__} could not load this {config.model_type} model's adapter back: it renames adapter "
            f"keys with transformers' conversion mapping and would drop {len(dropped)} of {len(state)} LoRA tensors (e.g. it "
            f"reads {dropped[0]}), so resume, eval and PeftModel.from_pretrained would lose them; pass --target-modules "
            "without the linears of that part, or use another peft version"
        )


def check_adapted(wanted: set[str], peft_model, cfg) -> None:
    """After injection: what peft adapted is exactly what was asked (and what `plan` counted)."""
    mismatch = adaptation_mismatch(expected_ranks(wanted, cfg), adapted_weights(peft_model))
    if mismatch:
        raise UserError(f"--target-modules: peft did not adapt this model as asked ({mismatch}); pass --target-modules explicitly")


def check_tuned(wanted: set[str], peft_model) -> None:
    """After injecting another adapter type: it adapts exactly the linears asked for."""
    tuned = {f"{base_name(name)}.weight" for name, m in peft_model.named_modules() if isinstance(m, BaseTunerLayer)}
    if tuned != wanted:
        missing, extra = sorted(wanted - tuned), sorted(tuned - wanted)
        raise UserError(
            f"--peft-type: peft did not adapt this model as asked ({len(missing)} left out, {len(extra)} added, e.g. "
            f"{(missing or extra)[0]}); pass --target-modules with linear layers only"
        )


def lora_config(cfg, targets: Targets):
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets.peft_target_modules(),
        target_parameters=list(targets.parameters) or None,
        use_rslora=cfg.rslora,
        use_dora=cfg.dora,
        rank_pattern=getattr(cfg, "rank_patterns", None) or {},
        alpha_pattern=getattr(cfg, "alpha_patterns", None) or {},
        layers_to_transform=getattr(cfg, "layers_to_transform", None),
        modules_to_save=getattr(cfg, "modules_to_save", None),
        trainable_token_indices=list(targets.tokens) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def token_ids(cfg, tokenizer) -> tuple[int, ...]:
    """--trainable-tokens as the tokenizer's ids; a token it doesn't have (it would split the text
    into several) is one error line."""
    vocab = tokenizer.get_vocab()
    for token in getattr(cfg, "trainable_tokens", None) or ():
        if token not in vocab:
            pieces = tokenizer.tokenize(token)
            raise UserError(
                f"--trainable-tokens: {token!r} is not a token of this tokenizer (it splits into {pieces}); add it to the tokenizer "
                "first, or pass tokens it has"
            )
    return tuple(vocab[t] for t in getattr(cfg, "trainable_tokens", None) or ())


def check_modules_to_save(cfg, model) -> None:
    """--modules-to-save names modules of the model (the full name or a dotted suffix, as peft matches them)."""
    names = [n for n, _ in model.named_modules() if n]
    for wanted in getattr(cfg, "modules_to_save", None) or ():
        if not any(n == wanted or n.endswith("." + wanted) for n in names):
            raise UserError(f"--modules-to-save: {wanted} is not a module of this model; name one such as lm_head or embed_tokens")


def is_lora_layer(module) -> bool:
    """A LoRA layer proper: peft's AdaLoRA layers are LoraLayers too, with SVD triplets in place of A, B
    (another --peft-type, lora_tune.models.adapter_types)."""
    return isinstance(module, LoraLayer) and not isinstance(module, AdaLoraLayer)


def lora_layers(module, prefix: str = ""):
    """(full name, layer) of every LoRA layer inside `module`."""
    for name, m in module.named_modules(prefix=prefix):
        if is_lora_layer(m):
            yield name, m


def lora_targets(cfg: TrainConfig, config, tokens: tuple[int, ...] = ()) -> Targets | None:
    """--target-modules resolved on a meta skeleton of the model (shapes only, no weights), so a
    bad name or an unsupported combination fails before loading; what is adapted is logged.
    `tokens`: --trainable-tokens' ids (token_ids)."""
    if model_class(config) is None:
        if tokens or getattr(cfg, "modules_to_save", None):
            raise UserError("--trainable-tokens / --modules-to-save: this model runs remote code, whose modules are only known once loaded")
        return None  # remote code: resolved on the loaded model
    skeleton = meta_model(config)
    check_modules_to_save(cfg, skeleton)
    inventory = Inventory.of(skeleton)
    if inventory.tied and not cfg.target_modules:
        log.warning(
            "LoRA targets: %s left out: their weights are tied across layers (one tensor in the checkpoint), so LoRA on them "
            "could not be merged",
            ", ".join(inventory.tied),
        )
    meta = PeftOnMeta(config, cfg)
    targets = peft_exact_targets(config, cfg, replace(resolve_targets(inventory, cfg), tokens=tuple(tokens)), meta)
    check_loads_back(config, cfg, targets, meta)
    if targets.vision and multimodal_body(skeleton) is None:
        raise UserError(
            f"--train-vision: {config.model_type}'s vision tower runs apart from its language model, which lora-tune doesn't "
            "train on images; leave it out"
        )
    log.info("LoRA targets: %s", targets.describe(skeleton))
    if targets.scope is not None and not targets.vision and is_image_text(config):
        shared = sorted(set(targets.modules) & set(inventory.elsewhere))
        log.info(
            "LoRA targets: %s also name layers outside the language model (vision tower / projector), which stay frozen and unadapted",
            ", ".join(shared),
        )
    fused = sum(p.numel() for p in skeleton.parameters() if p.dim() == 3)
    note = unquantized_experts(cfg.precision, fused, sum(p.numel() for p in skeleton.parameters()))
    if note:
        log.warning(note)
    return targets
