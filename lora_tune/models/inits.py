"""LoRA's initial values (--init-lora-weights), layer by layer with peft's own per-layer inits, and
what the inits that change the base mean for saving and loading.

PiSSA and OLoRA (CorDA, LoRA-GA too: lora_tune.models.data_inits) move part of the weight into the
adapter (A0, B0) and leave the residual W - s B0 A0 in the base. Trained, such an adapter only works
on that residual base, so lora-tune writes it converted into a plain LoRA of the original base, as peft's
`save_pretrained(path_initial_model_for_weight_conversion=...)` does: W + s (BA - B0 A0) is the
rank-2r LoRA [A; A0], [B, -B0] (alpha doubled, so the scale is the same). Merge, vLLM, GGUF, check-serving
and `PeftModel.from_pretrained(original base)` then take it as any LoRA. Checkpoints hold the same
converted adapter; a resume recomputes the init (seeded, so the same residual comes out) and reads its
trained A, B back as the first r ranks.
"""

from __future__ import annotations

import copy

import torch

from lora_tune.errors import UserError
from lora_tune.models import data_inits
from lora_tune.models.targets import lora_layers

# Inits that leave a residual base (prefixes: pissa_niter_N is PiSSA).
CHANGES_BASE = ("pissa", "olora", "corda", "lora_ga")


def changes_base(init: str | None) -> bool:
    return init is not None and init.startswith(CHANGES_BASE)


def initialise(layer, init: str | None) -> None:
    """One LoRA layer's initial values by peft's per-layer init `init` (None: peft's default, Kaiming A
    and zero B), drawn from the caller's seeded generator. An init that changes the base keeps its
    (A0, B0) on the layer for the conversion at save time."""
    device = layer.lora_A["default"].weight.device  # where the layer's LoRA weights live (filled, not meta)
    if init is None or init == "gaussian":
        layer.reset_lora_parameters("default", init_lora_weights=True if init is None else init)
    elif init == "orthogonal":
        layer.orthogonal_init("default")
    elif init.startswith("pissa"):
        layer.pissa_init("default", init)
    elif init == "olora":
        layer.olora_init("default")
    elif data_inits.needs_data(init):
        data_inits.initialise(layer, init)
    else:
        raise ValueError(f"unknown LoRA init {init}")
    for part in (layer.lora_A["default"], layer.lora_B["default"]):
        part.to(device)  # orthogonal_init makes new parameters on the default device
    if changes_base(init):
        layer.lora_tune_initial = tuple(p["default"].weight.detach().float().cpu().clone() for p in (layer.lora_A, layer.lora_B))


def initial_state(peft_model) -> dict[str, torch.Tensor]:
    """(A0, B0) of every layer whose init changed the base, under peft's saved names; empty for the others."""
    found = {}
    for name, layer in lora_layers(peft_model):
        initial = getattr(layer, "lora_tune_initial", None)
        if initial is not None:
            found[f"{name}.lora_A.weight"], found[f"{name}.lora_B.weight"] = initial
    return found


def converted(state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], lora_cfg):
    """(state, config) of the adapter as a plain LoRA of the original base: each adapted layer's
    [A; A0] and [B, -B0], rank and alpha doubled (with rsLoRA alpha x sqrt 2: alpha / sqrt(r) stays),
    rank and alpha patterns doubled, as peft's conversion writes them. Other tensors (modules to save)
    are kept as they are."""
    out = {}
    for key, value in state.items():
        if key in initial and "lora_A" in key:
            out[key] = torch.cat([value, initial[key].to(value.dtype)], dim=0)
        elif key in initial and "lora_B" in key:
            out[key] = torch.cat([value, -initial[key].to(value.dtype)], dim=1)
        else:
            out[key] = value
    config = copy.deepcopy(lora_cfg)
    config.init_lora_weights = True
    config.r *= 2
    config.lora_alpha = config.lora_alpha * 2**0.5 if config.use_rslora else config.lora_alpha * 2
    config.rank_pattern = {k: 2 * v for k, v in (config.rank_pattern or {}).items()}
    config.alpha_pattern = {k: 2 * v for k, v in (config.alpha_pattern or {}).items()}
    return out, config


def own_form(state: dict[str, torch.Tensor], peft_model, where) -> dict[str, torch.Tensor]:
    """A saved adapter in the form this run trains: for an init that changed the base, each layer's
    first r ranks of the converted [A; A0], [B, -B0], whose other half must be this run's (A0, -B0):
    otherwise the adapter did not start from this init on this base."""
    initial = initial_state(peft_model)
    if not initial:
        return state
    own = {}
    for key, value in state.items():
        if key not in initial:
            own[key] = value
            continue
        a = "lora_A" in key
        r = value.shape[0 if a else 1] // 2
        trained, start = (value[:r], value[r:]) if a else (value[:, :r], -value[:, r:])
        if start.shape != initial[key].shape or not torch.equal(start.float(), initial[key]):
            raise UserError(
                f"{where}: {key} did not start from this run's initial adapter (its second half is not this init's A0/B0 on "
                "this base); resume it with the options and base it was trained with"
            )
        own[key] = trained.contiguous()
    return own


INIT_BATCHES = 8  # --init-batches' default: micro-batches the statistics pass of eva / corda / lora_ga reads


def init_batches(cfg) -> int:
    return cfg.init_batches or INIT_BATCHES


def check(cfg, needs_reference: bool, partitioned: bool = False, online: bool = False) -> None:
    """What an init can't be combined with, one line each, before loading. `partitioned`: the backend
    partitions or streams the base (ZeRO-3, FSDP2); `online`: the objective generates its own data."""
    init = cfg.init_lora_weights
    if getattr(cfg, "init_batches", None) and not data_inits.needs_data(init):
        given = f"--init-lora-weights {init}" if init else "the default init"
        raise UserError(f"--init-batches sizes the statistics pass of --init-lora-weights eva, corda or lora-ga; leave it out with {given}")
    if data_inits.needs_data(init):
        what = f"--init-lora-weights {init.replace('_', '-')} runs the base over the run's first micro-batches before the adapter goes in"
        if partitioned:
            raise UserError(
                f"{what}; this backend partitions or streams the base, so no rank holds a whole one to run: use --zero 2 "
                "(or --zero 1), or pissa, which decomposes each layer as it streams in"
            )
        if online:
            raise UserError(
                f"{what}; --objective {cfg.objective} has prompts, not training sequences: start from an SFT run "
                "(--init-adapter) or use pissa"
            )
        if cfg.init_adapter:
            raise UserError(f"{what}; --init-adapter starts from that adapter's values instead: leave out one of them")
    if init == "orthogonal" and cfg.rank % 2:
        raise UserError(
            f"--init-lora-weights orthogonal splits the rank into two halves (so that B A = 0): pass an even --rank, not {cfg.rank}"
        )
    if init == "orthogonal" and cfg.precision in ("8bit", "4bit"):
        raise UserError(
            f"--init-lora-weights orthogonal: peft's orthogonal init casts A and B to the base weight's storage dtype, an integer "
            f"one on a {cfg.precision} base, where they can't train: use gaussian (or the default), or --precision bf16"
        )
    if not changes_base(init):
        return
    what = f"--init-lora-weights {init.replace('_', '-')} moves part of each weight into the adapter and trains the residual base"
    if cfg.precision in ("8bit", "4bit"):
        raise UserError(
            f"{what}; on a {cfg.precision} base that means decomposing the dequantized weight and re-quantizing the residual "
            "(QPiSSA), which lora-tune doesn't do yet: use --precision bf16"
        )
    if cfg.dora:
        raise UserError(
            f"{what}; DoRA's magnitudes are norms of the residual weights, so the adapter could not be written as a LoRA of the "
            "original base: leave out --dora"
        )
    if cfg.init_adapter:
        raise UserError(f"{what}; --init-adapter continues an adapter of the original base, not of a residual one: leave out one of them")
    if needs_reference:
        raise UserError(
            f"{what}; the reference policy (the base without the adapter) would be that residual, not the original model: use "
            "--init-lora-weights gaussian or orthogonal (they keep the base), or an objective without a reference"
        )
