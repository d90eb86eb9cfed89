"""Inject LoRA adapters (peft) into the frozen base, seeded the same on every backend, with gradient
checkpointing set up for them; write them out in peft's layout and read them back."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.integrations import gather_params_ctx
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers.modeling_layers import GradientCheckpointingLayer

from lora_tune.errors import UserError
from lora_tune.files import fsync_path, remove_tree, write_safetensors
from lora_tune.models import data_inits, inits
from lora_tune.models.adapter_types import registry as adapter_types
from lora_tune.models.adapter_types.registry import is_lora
from lora_tune.models.loading import checkpointing_on
from lora_tune.models.structure import meta_model
from lora_tune.models.targets import Targets, check_adapted, check_tuned, is_lora_layer, lora_config, lora_layers, resolve_targets

if TYPE_CHECKING:
    from lora_tune.config import TrainConfig

log = logging.getLogger("lora_tune")


@dataclass(frozen=True)
class Checkpointing:
    """Which decoder layers recompute their activations in backward: none (`enabled` false), or
    all but the last `kept_layers`, which keep theirs (--gradient-checkpointing auto's choice)."""

    enabled: bool
    kept_layers: int = 0

    @classmethod
    def of(cls, cfg) -> Checkpointing:
        """The setting of the configuration alone (auto, undecided, is every layer)."""
        return cls(cfg.gradient_checkpointing != "off")


def checkpointed_layers(model) -> list:
    """The decoder layers transformers can checkpoint, in order."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _output_requires_grad(module, inputs, output):
    output.requires_grad_(True)


def require_grads_from_text_embeddings(model) -> None:
    """The checkpointed layers' inputs require grad (the reentrant path some remote-code models use
    needs it), from the language model's embedding output only. peft and transformers call
    `enable_input_require_grads()`, which in an image-text model hooks every sub-model's embeddings,
    the frozen vision tower's patch embedding too: autograd then keeps every tower block's
    activations, and under ZeRO-3 the rank whose micro-batch held an image gathers the tower again
    in backward while the others don't (a hang)."""
    model.disable_input_require_grads()
    model.get_input_embeddings().register_forward_hook(_output_requires_grad)


def enable_checkpointing(model, checkpointing: Checkpointing, offload: bool) -> None:
    # Non-reentrant checkpointing computes grads for LoRA weights even though the block inputs
    # come from frozen embeddings; input grads are enabled too, so the reentrant path used by
    # some remote-code models doesn't hit "element 0 does not require grad" (transformers #42489).
    checkpointing_on(model, offload)  # offload: transformers keeps the checkpointed layer inputs in pinned host memory
    model.disable_input_require_grads()  # its hooks reach a vision tower: see require_grads_from_text_embeddings
    if checkpointing.kept_layers:
        # The layers' own switch (GradientCheckpointingLayer.gradient_checkpointing): the last ones
        # run plainly and keep their activations.
        for layer in checkpointed_layers(model)[-checkpointing.kept_layers :]:
            layer.gradient_checkpointing = False


def peft_config(cfg, targets: Targets, model_type: str):
    """peft's config of the run's adapter: LoRA's, or another --peft-type's (lora_tune.models.adapter_types)."""
    if is_lora(cfg):
        return lora_config(cfg, targets)
    return adapter_types.peft_config(cfg, targets.peft_target_modules(), model_type)


def uniform_lora(cfg) -> bool:
    """A LoRA of --rank on every target, nothing else trained: what the planner counts from the shapes
    alone; any other adapter is counted by peft itself (`trained_sizes`)."""
    extras = ("rank_pattern", "layers_to_transform", "modules_to_save", "trainable_tokens")
    return is_lora(cfg) and not any(getattr(cfg, name, None) for name in extras)


COMPILER_VARIABLES = ("CC", "CXX")


@contextmanager
def peft_building():
    """Around peft building adapter layers (get_peft_model, PeftModel.from_pretrained). peft 0.21's
    BOFT layers try to build a CUDA extension as they are made, setting $CC and $CXX to gcc for it,
    and when the build fails (no CUDA, no ninja) leave them set: its copy of accelerate's
    patch_environment restores them in no `finally`. Every C++ build after that in the process and
    in the processes it starts (Inductor's kernels under --compile, --nproc's ranks) would link with
    gcc, not g++, and fail to load ("undefined symbol ... basic_ostringstream"). They are put back."""
    saved = {name: os.environ.get(name) for name in COMPILER_VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def trained_sizes(config, cfg, targets: Targets) -> tuple[int, ...] | None:
    """Element counts of every tensor the adapter trains, as peft builds it on a meta skeleton of
    `config` (no memory): exact for every --peft-type, pattern, layer list, trainable token and module
    kept in full. Token ids stand in for --trainable-tokens (how many, not which, sizes them). None
    when peft can't build the type without real values (BOFT computes its permutations on them)."""
    if getattr(cfg, "trainable_tokens", None) and not targets.tokens:
        targets = replace(targets, tokens=tuple(range(len(cfg.trainable_tokens))))
    try:
        with torch.device("meta"), peft_building():
            model = get_peft_model(meta_model(config), peft_config(cfg, targets, config.model_type))
    except (RuntimeError, NotImplementedError) as e:
        log.info("plan: peft can't size a --peft-type %s adapter on a meta skeleton (%s); planned as a LoRA of --rank", cfg.peft_type, e)
        return None
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


def add_lora(model, cfg, base_id: str, targets: Targets | None = None, checkpointing: Checkpointing | None = None, first_batches=None):
    """Wrap the base with trainable LoRA layers (fp32), checkpointing set up for peft.

    Returns the PeftModel; only LoRA (and DoRA magnitude) parameters require grad. `targets`:
    resolved before loading (from a meta skeleton); else resolved on `model`. `checkpointing`:
    decided for this run (lora_tune.preflight); else the configuration's setting. `first_batches`:
    a callable giving the run's first micro-batches (model inputs), for an init that learns from
    them (lora_tune.models.data_inits), run on the plain base before the adapter goes in.
    """
    targets = targets or resolve_targets(model, cfg)
    wanted = targets.weights(model)
    if data_inits.needs_data(cfg.init_lora_weights):
        data_inits.statistics_pass(model, cfg.init_lora_weights, lora_config(cfg, targets), first_batches())
    checkpointing = checkpointing or Checkpointing.of(cfg)
    if checkpointing.enabled:
        enable_checkpointing(model, checkpointing, getattr(cfg, "activation_offload", False))
    if not is_lora(cfg):  # another type (lora_tune.models.adapter_types): peft initialises it from the run's seed, alike on every rank
        torch.manual_seed(cfg.seed)  # (and a type that can be filled layer by layer is drawn again per layer below)
    with peft_building():
        peft_model = get_peft_model(model, peft_config(cfg, targets, model.config.model_type))
    if is_lora(cfg):
        check_adapted(wanted, peft_model, cfg)
    else:
        check_tuned(wanted, peft_model)
    if checkpointing.enabled:
        require_grads_from_text_embeddings(model)
    peft_model.peft_config["default"].base_model_name_or_path = base_id
    peft_model.lora_tune_seed = cfg.seed
    peft_model.lora_tune_init = cfg.init_lora_weights
    reset = peft_model.lora_tune_reset = adapter_types.reset_of(cfg)  # another type's per-layer init (layer-by-layer loading too)
    for name, layer in lora_layers(peft_model):
        if not is_meta(layer):  # a meta skeleton gets its values layer by layer (lora_tune.models.layerwise)
            init_lora_layer(layer, name, cfg.seed, cfg.init_lora_weights)
    if any(tuner_is_meta(layer) for _, layer in tuner_layers(peft_model)):
        adapter_types.draw_fixed(cfg, peft_model)  # before the layers stream in (they hold them)
    for name, layer in tuner_layers(peft_model) if reset else ():
        if not tuner_is_meta(layer):  # drawn as layer-by-layer loading draws them
            reset_tuner_layer(layer, name, cfg.seed, reset)
    to_fp32(peft_model)
    torch.manual_seed(cfg.seed)  # dropout draws from here: part of the seeded math
    return peft_model


def to_fp32(module) -> None:
    for p in module.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # LoRA trains in fp32 whatever the base is stored in


def is_meta(layer) -> bool:
    return any(p.device.type == "meta" for p in layer.lora_A.parameters())


@contextmanager
def seeded_by_name(seed: int, name: str):
    """The default generator seeded by the run's seed and a layer's name, the caller's state restored
    after: a layer's adapter comes out the same whichever order or process draws it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        yield


@contextmanager
def base_weight_whole(layer):
    """The layer's base weight whole, for an init that reads and rewrites it: under ZeRO-3 gathered (this
    one layer) and rank 0's result partitioned again on exit (peft's gather_params_ctx; every rank computes
    the same, seeded); elsewhere as it is. peft assigns the residual as a new tensor: it is copied back into
    the weight's own storage, which ZeRO-3 partitions and frees again (a new one would stay whole on every rank)."""
    weight = layer.get_base_layer().weight
    with gather_params_ctx(weight, modifier_rank=0):
        storage = weight.data
        yield
        if weight.data is not storage:
            storage.copy_(weight.data)
            weight.data = storage


def init_lora_layer(layer, name: str, seed: int, init: str | None = None) -> None:
    """LoRA's initial values (--init-lora-weights, lora_tune.models.inits; by default A: peft's
    Kaiming uniform, B: zeros; DoRA: the base weight's row norms) from a generator seeded by the run's
    seed and the layer's name. The same values come out whichever order or process initialises the
    layers, so every backend starts from the same adapter, also when the base is filled layer by layer
    before being sharded, and a resume recomputes the same (PiSSA: the same residual base)."""
    # An init that reads and rewrites the base weight (the residual inits) needs it whole.
    with base_weight_whole(layer) if inits.changes_base(init) else contextlib.nullcontext(), seeded_by_name(seed, name):
        inits.initialise(layer, init)
    variant = getattr(layer, "lora_variant", {}).get("default")
    if variant is not None and any(p.device.type == "meta" for p in layer.lora_magnitude_vector.parameters()):
        variant.init(layer, adapter_name="default")  # DoRA magnitude from the now filled base weight


def materialize_adapter(unit, unit_name: str, seed: int, device: torch.device, init: str | None = None, reset=None) -> None:
    """Give the meta adapter layers inside `unit` real, seeded values on `device` (layer-by-layer loading:
    an init that decomposes the weight does so on this one filled layer). LoRA layers by `init`; another
    type's by its `reset` (lora_tune.models.adapter_types)."""
    for name, layer in lora_layers(unit, unit_name):
        if is_meta(layer):
            for part in (layer.lora_A, layer.lora_B):
                part.to_empty(device=device)
            init_lora_layer(layer, name, seed, init)
            to_fp32(layer)
    if reset is None:
        return
    for name, layer in tuner_layers(unit, unit_name):
        if not tuner_is_meta(layer):
            continue
        for container, item in list(tuner_entries(layer)):
            if isinstance(item, torch.nn.Parameter):
                container["default"] = torch.nn.Parameter(torch.empty_like(item, device=device))
            else:
                empty_meta_tensors(item, device)
        reset_tuner_layer(layer, name, seed, reset)
        for p in tuner_weights(layer):  # some resets make new parameters on the default device
            p.data = p.data.to(device)
        to_fp32(layer)


def empty_meta_tensors(module, device: torch.device) -> None:
    """`module`'s meta parameters and buffers made empty tensors on `device`, its real ones (a type's
    fixed tensors, made real before loading: AdapterType.fixed) moved there unchanged."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            fresh = torch.empty_like(p, device=device) if p.device.type == "meta" else p.data.to(device)
            setattr(sub, name, torch.nn.Parameter(fresh, requires_grad=p.requires_grad))
        for name, b in list(sub.named_buffers(recurse=False)):
            sub._buffers[name] = torch.empty_like(b, device=device) if b.device.type == "meta" else b.to(device)


def tuner_layers(module, prefix: str = ""):
    """(full name, layer) of every adapter layer of another --peft-type inside `module`."""
    for name, m in module.named_modules(prefix=prefix):
        if isinstance(m, BaseTunerLayer) and not is_lora_layer(m):
            yield name, m


def tuner_entries(layer):
    """(container, the run's adapter entry: a parameter or a module) of each of a tuner layer's
    `adapter_layer_names` that holds one."""
    for container_name in layer.adapter_layer_names:
        container = getattr(layer, container_name)
        if "default" in container:
            yield container, container["default"]


def tuner_weights(layer):
    """A tuner layer's own adapter weights."""
    for _, item in tuner_entries(layer):
        yield from [item] if isinstance(item, torch.nn.Parameter) else item.parameters()


def tuner_is_meta(layer) -> bool:
    return any(p.device.type == "meta" for p in tuner_weights(layer))


def reset_tuner_layer(layer, name: str, seed: int, reset) -> None:
    """Another type's layer at peft's default init, drawn as LoRA's are (`seeded_by_name`)."""
    with seeded_by_name(seed, name):
        reset(layer)


def trainable_state_dict(peft_model, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's saved names (no '.default'), on CPU, contiguous; taken from
    `state_dict` when given (gathered from shards), else from the model."""
    state = get_peft_model_state_dict(peft_model, state_dict=state_dict)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def check_adapter_state(state: dict[str, torch.Tensor], lora_cfg) -> None:
    """Refuse to write an empty or shapeless adapter (the ZeRO-3 failure mode, peft #2892)."""
    if not state:
        raise RuntimeError("the adapter state is empty; refusing to write it")
    for name, t in state.items():
        if t.numel() == 0:
            raise RuntimeError(f"adapter tensor {name} is empty (shape {tuple(t.shape)}); refusing to write it")
        # r rows; fused expert tensors (target_parameters) stack one rank-r factor per expert.
        if "lora_A" not in name:
            continue
        rank = getattr(lora_cfg, "init_r", lora_cfg.r)  # AdaLoRA's are at its starting rank, written whole
        rows_ok = t.shape[0] % rank == 0 if lora_cfg.target_parameters else t.shape[0] == rank
        if not rows_ok and not lora_cfg.rank_pattern:
            raise RuntimeError(f"adapter tensor {name} has shape {tuple(t.shape)}, expected rank {rank} rows")


def save_adapter(peft_model, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write adapter_config.json + adapter_model.safetensors into out_dir (peft's layout).

    Each file is written to a temporary name and renamed, so a crash leaves the old file or the
    new one, never half of one, and a failed write leaves no temporary file.
    """

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora_cfg = peft_model.peft_config["default"]
    state = trainable_state_dict(peft_model) if state is None else state
    initial = inits.initial_state(peft_model)
    if initial:  # PiSSA / OLoRA: written as a LoRA of the original base (lora_tune.models.inits)
        state, lora_cfg = inits.converted(state, initial, lora_cfg)
    check_adapter_state(state, lora_cfg)
    tmp_weights = out / f".adapter_model.safetensors.tmp-{os.getpid()}"
    tmp_config_dir = out / f".adapter_config.tmp-{os.getpid()}"
    try:
        write_safetensors(tmp_weights, state, metadata={"format": "pt"})
        fsync_path(tmp_weights)
        lora_cfg.save_pretrained(str(tmp_config_dir))
        fsync_path(tmp_config_dir / "adapter_config.json")
        os.replace(tmp_weights, out / "adapter_model.safetensors")
        os.replace(tmp_config_dir / "adapter_config.json", out / "adapter_config.json")
    finally:  # a failed write (full disk) leaves no temporary file behind; a kill's are removed on --resume
        remove_tree(tmp_weights)
        remove_tree(tmp_config_dir)


def load_adapter_weights(peft_model, adapter_dir: str | Path) -> None:
    """Load adapter weights saved by save_adapter back into an identically configured PeftModel."""
    path = Path(adapter_dir) / "adapter_model.safetensors"
    result = set_peft_model_state_dict(peft_model, read_adapter(peft_model, path))
    if getattr(result, "unexpected_keys", None):
        raise UserError(f"{path} does not match this LoRA configuration (unexpected: {result.unexpected_keys[:3]})")


def read_adapter(peft_model, path: Path) -> dict[str, torch.Tensor]:
    """An adapter file written by save_adapter, in the form `peft_model` trains (a converted PiSSA /
    OLoRA adapter: its trained half, lora_tune.models.inits.own_form)."""
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable or truncated ({e}); delete that checkpoint to resume from an older one") from None
    return inits.own_form(state, peft_model, path)


def check_init_adapter(cfg: TrainConfig, targets: Targets | None) -> None:
    """--init-adapter: an adapter folder whose shape is this run's (rank, alpha, targets, variants)."""
    if not cfg.init_adapter:
        return
    folder = Path(cfg.init_adapter).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise UserError(f"--init-adapter: {folder} is not an adapter folder (needs adapter_config.json and adapter_model.safetensors)")
    try:
        saved = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--init-adapter: {config_file} is unreadable ({e})") from None
    if not isinstance(saved, dict):
        raise UserError(f"--init-adapter: {config_file} is not an adapter config")
    wanted = {"r": cfg.rank, "lora_alpha": cfg.lora_alpha, "use_rslora": cfg.rslora, "use_dora": cfg.dora}
    if targets is not None:
        wanted["target_modules"] = targets.peft_target_modules()
    defaults = {"use_rslora": False, "use_dora": False}  # peft's, for configs written without them
    found = {k: saved.get(k, defaults.get(k)) for k in wanted}
    if isinstance(found.get("target_modules"), list) and isinstance(wanted.get("target_modules"), list):
        found["target_modules"], wanted["target_modules"] = sorted(found["target_modules"]), sorted(wanted["target_modules"])

    def shown(v):
        return f"{v:g}" if isinstance(v, float) else repr(v)

    differing = [f"{k} {shown(found[k])} (this run: {shown(wanted[k])})" for k in wanted if found[k] != wanted[k]]
    if differing:
        raise UserError(
            f"--init-adapter: {folder} has {'; '.join(differing)}; pass the options it was trained with (e.g. --rank "
            f"{saved.get('r')} --alpha {saved.get('lora_alpha')})"
        )
