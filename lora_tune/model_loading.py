"""Load the tokenizer and the base model in the requested precision.

The tokenizer is loaded first and alone: it is cheap, and the data stage needs it to validate the
dataset before we spend minutes (or an hour, for a 70B) loading weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, BitsAndBytesConfig
from transformers.utils import is_flash_attn_2_available

from lora_tune.errors import UserError, first_line
from lora_tune.model_structure import auto_class, model_class
from lora_tune.tiny_configs import shrink_config

log = logging.getLogger("lora_tune")

# Packed vs alone, fp32: attention that keeps samples apart agrees to rounding (~1e-6); a leak moves
# logits by orders of magnitude more.
PACKING_TOLERANCE = 1e-4

# What the base weights are stored in, and what matmuls run in, per --precision.
WEIGHT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "8bit": torch.bfloat16, "4bit": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    return WEIGHT_DTYPE[precision]


def load_tokenizer(base_path: str, trust_remote_code: bool = False):
    if trust_remote_code:
        log.warning("trust_remote_code is on: code from %s will run on this machine", base_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    except OSError as e:
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
    (no device_map). Quantized bases under ZeRO-3 or FSDP2 are streamed by lora_tune.layerwise."""
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
    quant = quantization_config(precision)
    if quant is not None:
        kwargs["quantization_config"] = quant
    # device_map puts each weight straight onto its device while loading, so the host never holds
    # a second copy (and bitsandbytes quantises shard by shard as the weights arrive).
    if not zero3:
        kwargs["device_map"] = {"": device.index if device.type == "cuda" else str(device)}
    try:
        model = auto_class(load_config(base_path, trust_remote_code)).from_pretrained(base_path, **kwargs)
    except OSError as e:
        raise UserError(f"--base: could not load weights from {base_path} ({first_line(e)})") from None
    model.config.use_cache = False  # the KV cache is useless in training and conflicts with checkpointing
    for p in model.parameters():
        p.requires_grad_(False)
    return model


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


def attention_implementation(choice: str, config, device: torch.device) -> str:
    """--attn-implementation resolved: auto = flash_attention_2 when installed on a GPU and the model
    supports it, else sdpa (eager for the few models without sdpa)."""
    cls = model_class(config)
    if choice == "flash_attention_2":
        if device.type != "cuda" or not is_flash_attn_2_available():
            raise UserError(
                "--attn-implementation flash_attention_2 needs a CUDA GPU and the flash-attn package (pip install flash-attn); use sdpa"
            )
    if choice != "auto":
        return choice
    if device.type == "cuda" and cls is not None and getattr(cls, "_supports_flash_attn", False):
        if is_flash_attn_2_available():
            return "flash_attention_2"
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def packing_refusal(config) -> str | None:
    """Why samples can't be packed into one row for this model, or None, decided by what the model
    does rather than by what its code looks like: a tiny random model of the same class, with the
    same kinds of layers (`tiny_configs.shrink_config`), runs three samples packed in one row
    (position_ids restarting, no attention mask, as `batching.collate` builds them) and each alone.
    Packing is on only when every sample's logits are its own: attention layers whose masks come
    from the positions pass; recurrent state (Mamba, linear attention) or positions the model
    ignores (ALiBi) let samples leak into each other and fail."""
    cls = model_class(config)
    if cls is None:
        name = type(config).__name__
        return f"{name} is not one of transformers' own causal LMs (remote code?), so packed samples can't be verified to stay apart"
    try:
        tiny = shrink_config(config)
    except Exception as e:  # noqa: BLE001 - config classes validate their fields in many ways
        return f"a tiny {cls.__name__} to check it could not be configured ({first_line(e)})"
    key = f"{cls.__name__}:{tiny.to_json_string()}"
    if key not in _PACKING_PROBED:
        _PACKING_PROBED[key] = _packing_probe(cls, tiny)
    return _PACKING_PROBED[key]


_PACKING_PROBED: dict[str, str | None] = {}  # this process's verdicts, by model class and tiny config


def _packing_probe(cls, config) -> str | None:
    lengths = (5, 7, 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            model = cls(config).float().eval()
        except Exception as e:  # noqa: BLE001 - a model class can refuse a shrunk config in many ways
            return f"a tiny {cls.__name__} to check it could not be built ({first_line(e)})"
        vocab = config.get_text_config().vocab_size
        samples = [torch.randint(3, vocab, (n,)) for n in lengths]
    row = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    try:
        with torch.no_grad():
            packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[0]
            alone = torch.cat([model(input_ids=x[None], use_cache=False).logits[0] for x in samples])
    except Exception as e:  # noqa: BLE001 - e.g. a forward that takes no position_ids
        return f"{cls.__name__} can't run a packed row ({first_line(e)})"
    drift = float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-6))
    if not drift <= PACKING_TOLERANCE:
        return f"{cls.__name__} lets packed samples see each other (a tiny one's logits move by {drift:.1e} when packed)"
    return None


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
