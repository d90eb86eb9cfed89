"""Load the tokenizer and the base model in the requested precision.

The tokenizer is loaded first and alone: it is cheap, and the data stage needs it to validate the
dataset before we spend minutes (or an hour, for a 70B) loading weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, BitsAndBytesConfig, FineGrainedFP8Config, Mxfp4Config
from transformers.utils import is_flash_attn_2_available

from lora_tune.errors import UserError, first_line
from lora_tune.models import attention, sequence_parallel
from lora_tune.models.head import SOFTCAP_KEYS
from lora_tune.models.structure import auto_class, decoder_body, model_class
from lora_tune.models.tiny.configs import shrink_config
from lora_tune.models.tiny.sizes import TEXT_VOCAB

log = logging.getLogger("lora_tune")

# A tiny model's logits two ways (packed vs alone; head over the body vs the model's own), fp32:
# equal computations agree to rounding (~1e-6); a leak or a missing transform moves them by orders
# of magnitude more.
PROBE_TOLERANCE = 1e-4

# What the base weights are stored in, and what matmuls run in, per --precision.
WEIGHT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "8bit": torch.bfloat16, "4bit": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    return WEIGHT_DTYPE[precision]


def load_tokenizer(base_path: str, trust_remote_code: bool = False):
    if trust_remote_code:
        log.warning("trust_remote_code is on: code from %s will run on this machine", base_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # ValueError: a tokenizer file that is not JSON, not UTF-8, or not a tokenizer
        raise UserError(
            f"--base: could not load a tokenizer from {base_path} ({first_line(e)}); check the id/path, your network or HF_TOKEN"
        ) from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"--base: the tokenizer of {base_path} has no EOS token; the model could never learn to stop")
    return tokenizer


def quantization_config(precision: str):
    if precision == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if precision == "4bit":
        # QLoRA's recipe: NF4 storage, double-quantised scales (~4.127 bits/param), bf16 matmuls.
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
        )
    return None


def has_safetensors(base_path: str) -> bool:
    p = Path(base_path)
    if p.is_dir():
        return any(p.glob("*.safetensors"))
    return True  # hub ids: from_pretrained picks safetensors when the repo has them


def load_base_model(
    base_path: str,
    precision: str,
    device: torch.device,
    trust_remote_code: bool = False,
    allow_bin: bool = False,
    zero3: bool = False,
    attn_implementation: str = "sdpa",
):
    """The frozen base, on `device`, in `precision`; nothing trainable yet. `zero3`: the weights are
    built under zero.Init (a bf16/fp32 base), where DeepSpeed places each rank's partition itself
    (no device_map). Quantized bases under ZeRO-3 or FSDP2 are streamed by lora_tune.models.layerwise."""
    if not allow_bin and not has_safetensors(base_path):
        raise UserError(
            f"--base: {base_path} has only pickle (.bin) weights, which can run code when loaded; convert them to safetensors "
            "or pass --allow-bin if you trust them"
        )
    kwargs = dict(
        dtype=WEIGHT_DTYPE[precision],
        trust_remote_code=trust_remote_code,
        use_safetensors=None if allow_bin else True,
        attn_implementation=attn_implementation,
    )
    config = load_config(base_path, trust_remote_code)
    quant = quantization_config(precision) or dequantizing(config, precision)
    if quant is not None:
        kwargs["quantization_config"] = quant
    # device_map puts each weight straight onto its device while loading, so the host never holds
    # a second copy (and bitsandbytes quantises shard by shard as the weights arrive).
    if not zero3:
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else str(device)}
    try:
        model, info = auto_class(config).from_pretrained(base_path, output_loading_info=True, **kwargs)
    except OSError as e:
        raise UserError(f"--base: could not load weights from {base_path} ({first_line(e)})") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        # transformers initialises what the files lack at random and goes on: training on that
        # would be training on noise.
        raise UserError(
            f"--base: {base_path} has no weights for {len(missing)} tensors {type(model).__name__} needs (e.g. {missing[0]}); "
            "transformers would fill them at random. The checkpoint is incomplete or of another model class"
        )
    model.config.use_cache = False  # the KV cache is useless in training and conflicts with checkpointing
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def dequantizing(config, precision: str = "bf16"):
    """How to load a checkpoint that ships quantized weights (gpt-oss MXFP4 experts, DeepSeek's FP8
    blocks) for training or merging: transformers' own quantization config with dequantize=True
    (on a GPU with the kernels installed it would otherwise keep them quantized, and untrainable).
    None for a plain checkpoint; one error line for what can't be done."""
    method = quant_method(config)
    if method is None:
        return None
    if precision in ("8bit", "4bit"):
        raise UserError(
            f"--precision {precision}: this checkpoint ships {method}-quantized weights, which are loaded dequantized and can't "
            "be requantized by bitsandbytes in the same load; use --precision bf16"
        )
    if method == "mxfp4":
        return Mxfp4Config(dequantize=True)
    if method == "fp8":
        return FineGrainedFP8Config(dequantize=True)
    raise UserError(f"--base: this checkpoint ships {method}-quantized weights, which lora-tune can't dequantize; give a bf16 checkpoint")


def quant_method(config) -> str | None:
    """How a checkpoint's weights are quantized on disk (fp8, mxfp4, ...), from its config; None when plain."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    return quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)


def load_config(base_path: str, trust_remote_code: bool = False):
    try:
        return AutoConfig.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"--base: could not read the config of {base_path} ({first_line(e)})") from None


def attention_implementation(cfg, config, device: torch.device) -> str:
    """--attn-implementation resolved: auto = flash_attention_2 when installed on a GPU and the model
    supports it; on a CPU with packed rows and eager layers, sdpa_packed (`lora_tune.models.attention`) for
    the models that call attention through transformers' interface; else sdpa (eager for the few
    models without sdpa). Under --sequence-parallel, that attention across the group's row shards
    (`lora_tune.models.sequence_parallel`)."""
    return sequence_parallel.implementation(_single_rank_attention(cfg, config, device), cfg.sequence_parallel)


def _single_rank_attention(cfg, config, device: torch.device) -> str:
    choice, cls = cfg.attn_implementation, model_class(config)
    per_sample = cls is not None and cls.is_backend_compatible()
    if choice == "flash_attention_2":
        if device.type != "cuda" or not is_flash_attn_2_available():
            raise UserError(
                "--attn-implementation flash_attention_2 needs a CUDA GPU and the flash-attn package (pip install flash-attn); use sdpa"
            )
    if choice == attention.NAME and not per_sample:
        raise UserError(
            f"--attn-implementation {attention.NAME}: {config.model_type} does not call attention through transformers' interface; use sdpa"
        )
    if choice == attention.NAME and cfg.compile:
        raise UserError(f"--attn-implementation {attention.NAME} runs Python per sample, which --compile can't capture; use sdpa")
    if choice != "auto":
        return choice
    if device.type == "cuda" and cls is not None and getattr(cls, "_supports_flash_attn", False):
        if is_flash_attn_2_available():
            return "flash_attention_2"
    if cls is not None and not getattr(cls, "_supports_sdpa", True):
        return "eager"
    return attention.NAME if device.type == "cpu" and cfg.packing and not cfg.compile and per_sample else "sdpa"


class NoTwin(Exception):
    """No tiny model of this config's class could be built (the message says why)."""


_TWINS: dict[str, object] = {}  # this process's tiny models, by class and tiny config


def tiny_twin(config):
    """A tiny random model of the config's class with the same kinds of layers (fp32, eval, seeded;
    `tiny_configs.shrink_config`), built once per process: what the probes below run. Raises NoTwin."""
    cls = model_class(config)
    if cls is None:
        raise NoTwin(f"{type(config).__name__} is not one of transformers' own models (remote code?)")
    try:
        tiny = shrink_config(config)
    except Exception as e:  # noqa: BLE001 - config classes validate their fields in many ways
        raise NoTwin(f"a tiny {cls.__name__} could not be configured ({first_line(e)})") from None
    key = f"{cls.__name__}:{tiny.to_json_string()}"
    if key not in _TWINS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            try:
                _TWINS[key] = cls(tiny).float().eval()
            except Exception as e:  # noqa: BLE001 - a model class can refuse a shrunk config in many ways
                _TWINS[key] = NoTwin(f"a tiny {cls.__name__} could not be built ({first_line(e)})")
    if isinstance(_TWINS[key], NoTwin):
        raise _TWINS[key]
    return _TWINS[key]


def probe_samples(lengths, seed: int) -> list[torch.Tensor]:
    """Random samples of text tokens (ids below the tiny vocabulary: none of the image/audio ids above it)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TEXT_VOCAB, (n,), generator=g) for n in lengths]


def packing_refusal(config) -> str | None:
    """Why samples can't be packed into one row for this model, or None, decided by what the model
    does rather than by what its code looks like: a tiny random model of the same class, with the
    same kinds of layers (`tiny_twin`), runs three samples packed in one row (position_ids
    restarting, no attention mask, as `batching.collate` builds them) and each alone, then the same
    row with one token of the middle sample changed. Packing is on only when every sample's logits
    are its own and the other samples' logits stay bit-identical: attention layers whose masks come
    from the positions pass; recurrent state (Mamba, gated delta nets), masks that ignore the
    positions (ALiBi, a model that builds its mask without them) and positions the model computes
    itself (mrope) let samples leak into each other and fail."""
    key = model_class(config), config.to_json_string()
    if key not in _PACKING_PROBED:
        try:
            _PACKING_PROBED[key] = packing_probe(tiny_twin(config))
        except NoTwin as e:
            _PACKING_PROBED[key] = f"packed samples can't be verified to stay apart: {e}"
    return _PACKING_PROBED[key]


_PACKING_PROBED: dict[tuple, str | None] = {}  # this process's verdicts


def packing_probe(model) -> str | None:
    """The probe of `packing_refusal` on one model: why its packed samples are not kept apart, or None."""
    lengths = (5, 7, 4)
    name = type(model).__name__
    if model._can_set_experts_implementation():
        # Token by token (batched_mm): grouped or per-expert matmuls round a token's result
        # differently when other tokens' routing changes (~1e-7), which is not a leak; computed
        # token by token, equal inputs give bit-identical outputs and only a real leak shows.
        model.set_experts_implementation("batched_mm")
    samples = probe_samples(lengths, seed=0)
    changed = [samples[0], samples[1].clone(), samples[2]]
    changed[1][3] = 3 + (int(changed[1][3]) - 2) % (TEXT_VOCAB - 3)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    try:
        with torch.no_grad():
            packed = model(input_ids=torch.cat(samples)[None], position_ids=positions, use_cache=False).logits[0]
            again = model(input_ids=torch.cat(changed)[None], position_ids=positions, use_cache=False).logits[0]
            alone = torch.cat([model(input_ids=x[None], use_cache=False).logits[0] for x in samples])
    except Exception as e:  # noqa: BLE001 - e.g. a forward that takes no position_ids
        return f"{name} can't run a packed row ({first_line(e)})"
    drift = float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-6))
    if not drift <= PROBE_TOLERANCE:
        return f"{name} lets packed samples see each other (a tiny one's logits move by {drift:.1e} when packed)"
    first, last = slice(0, lengths[0]), slice(lengths[0] + lengths[1], None)
    if not (torch.equal(packed[first], again[first]) and torch.equal(packed[last], again[last])):
        return f"{name} lets packed samples see each other (changing one sample moves its neighbours' logits)"
    return None


def head_refusal(config) -> str | None:
    """Why the chunked loss can't stand in for this model's logits, or None: it applies the output
    embeddings (and a Gemma-style soft cap) to the decoder body's last hidden states, which a
    tiny model of the class must reproduce (a transform between body and head, a logit scale under
    a name nobody listed, would not)."""
    try:
        return head_probe(tiny_twin(config))
    except NoTwin:
        return None  # remote code: its head is taken as given, as before this check existed


def head_probe(model) -> str | None:
    """The probe of `head_refusal` on one model."""
    head = model.get_output_embeddings()
    name = type(model).__name__
    if not isinstance(head, torch.nn.Linear):
        return f"{name} has no linear output head"
    ids = torch.stack(probe_samples((12,), seed=1))
    text = model.config.get_text_config(decoder=True)
    cap = next((getattr(text, k) for k in SOFTCAP_KEYS if getattr(text, k, None)), None)
    try:
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits.float()
            got = head(decoder_body(model)(input_ids=ids, use_cache=False).last_hidden_state).float()
    except Exception as e:  # noqa: BLE001 - a body that does not run alone
        return f"{name}'s decoder body does not run alone ({first_line(e)})"
    if cap:
        got = torch.tanh(got / cap) * cap
    drift = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
    if not drift <= PROBE_TOLERANCE:
        return f"{name}'s logits are not its output head applied to the decoder's last hidden states (a tiny one differs by {drift:.1e})"
    return None


def checkpointing_refusal(config) -> str | None:
    """Why gradient checkpointing can't be turned on for this model, or None: its class says it
    doesn't support it, or a tiny model of the class, frozen with checkpointing and input gradients
    on (as `adapter.add_lora` sets them up), can't run a backward pass (GIT's in-place embedding sum)."""
    cls = model_class(config)
    if cls is None:
        return None
    if not getattr(cls, "supports_gradient_checkpointing", True):
        return f"{cls.__name__} does not support gradient checkpointing (transformers)"
    key = cls, config.to_json_string()
    if key not in _CHECKPOINTING_PROBED:
        _CHECKPOINTING_PROBED[key] = _checkpointing_probe(cls, config)
    return _CHECKPOINTING_PROBED[key]


_CHECKPOINTING_PROBED: dict[tuple, str | None] = {}


def checkpointing_on(model, offload: bool = False) -> None:
    """Non-reentrant checkpointing of every decoder layer, under the name this transformers has
    (`activation_checkpointing_enable` since 5.2x, which also offloads the kept inputs to pinned host
    memory; `gradient_checkpointing_enable` before, as in the transformers vLLM pins)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)
    elif offload:
        raise UserError("--activation-offload needs transformers' activation_checkpointing_enable (transformers >= 5.2x); upgrade it")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _checkpointing_probe(cls, config) -> str | None:
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = cls(shrink_config(config)).float().train()
    except Exception:  # noqa: BLE001 - no tiny model: nothing to check here (packing says why)
        return None
    model.requires_grad_(False)
    try:
        checkpointing_on(model)
        model.enable_input_require_grads()
        model(input_ids=torch.stack(probe_samples((8,), seed=2)), use_cache=False).logits.float().sum().backward()
    except Exception as e:  # noqa: BLE001 - whatever a model does wrong under checkpointing
        return f"a tiny {cls.__name__} can't run a checkpointed backward pass ({first_line(e)})"
    return None


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def unquantized_experts(precision: str, fused: int, total: int) -> str | None:
    """bitsandbytes quantizes linear layers only: how much of the model (`fused` of `total`
    parameters in 3-D expert tensors) stays in bf16 under 8/4-bit. Said by `train` and `plan`."""
    if precision in ("8bit", "4bit") and fused:

        def count(n):
            return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

        return (
            f"{precision}: bitsandbytes quantizes linear layers only; this model's fused MoE expert tensors "
            f"({count(fused)} of {count(total)} parameters) stay in bf16"
        )
    return None
