"""GGUF for llama.cpp, Ollama and LM Studio: the model's tensors under llama.cpp's names and layouts,
its hyperparameters, tokenizer, special tokens and chat template as metadata.

Names come from the `gguf` package's own `TensorNameMap` for the family's `MODEL_ARCH`; the
tokenizer metadata from its `SpecialVocab`; quantization from `gguf.quants`; writing from
`GGUFWriter`, whose header, key-values and tensor infos go first so that tensor data can follow one
tensor at a time (`write_tensor_data`): a tensor is produced, transformed, written and dropped, never
the whole model in memory.

What llama.cpp's converter (convert_hf_to_gguf.py) does to weights beyond renaming, and which we
do the same way (transformers' GGUF loader undoes each, which is how the tests catch a missing one):
- Llama/Mistral: Q and K rows permuted from HF's rotate-half layout to GGML's interleaved rotary
  pairs (`LlamaModel.permute`; transformers' `LlamaTensorProcessor._reverse_permute_weights`).
- Gemma-2: RMSNorm weights stored as `w + 1` (llama.cpp multiplies by the stored weight; HF by 1 + w).
- GPT-2: Conv1D weights stored (in, out); GGML wants (out, in), so they are transposed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, Gemma2Config
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

from lora_tune.errors import UserError

log = logging.getLogger("lora_tune")

# The ggml type of 2-D weights per --quant (1-D tensors - norms, biases - stay F32, as llama.cpp's
# converter writes them: its kernels take them in F32).
QUANT_TYPES = ("f16", "bf16", "q8_0")


@dataclass(frozen=True)
class Family:
    """How one transformers model_type becomes a GGUF architecture."""

    arch: str  # gguf.MODEL_ARCH member name
    rotary_permute: bool = False  # llama.cpp's LlamaModel.permute on q_proj / k_proj rows
    norm_plus_one: bool = False  # Gemma: norms written as w + 1
    conv1d: bool = False  # GPT-2: Conv1D weights transposed to (out, in)
    general_name_hint: str = ""  # transformers reads a `llama` file whose general.name contains "mistral" as Mistral


FAMILIES = {
    "llama": Family("LLAMA", rotary_permute=True),
    # llama.cpp's converter writes Mistral as the llama architecture (MistralForCausalLM -> LlamaModel).
    "mistral": Family("LLAMA", rotary_permute=True, general_name_hint="mistral"),
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "gemma2": Family("GEMMA2", norm_plus_one=True),
    "phi3": Family("PHI3"),
    "gpt2": Family("GPT2", conv1d=True),
}

# Families of the README's table that are refused, and why (one line each, with the way out).
REFUSED = {
    "mixtral": "Mixtral: llama.cpp stores its experts stacked per layer (ffn_*_exps) under the llama architecture, and "
    "transformers' GGUF loader reads a llama file without experts, so the export could not be verified; "
    "serve the merged folder (`lora-tune merge`) with vLLM or transformers instead",
    "gpt_neox": "GPT-NeoX: transformers' GGUF loader has no gptneox architecture, so an export could not be read back and "
    "verified; serve the merged folder (`lora-tune merge`) with vLLM or transformers instead",
}


def family_of(config: dict) -> Family:
    """The family for a config.json, or a UserError naming why not (before anything heavy)."""
    model_type = config.get("model_type", "")
    if model_type in REFUSED:
        raise UserError(f"--format gguf: {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise UserError(
            f"--format gguf: no GGUF mapping for model_type {model_type!r} (exported: {', '.join(sorted(FAMILIES))}); "
            "serve the merged folder (`lora-tune merge`) with vLLM or transformers instead"
        )
    family = FAMILIES[model_type]
    if model_type == "gemma2":
        # llama.cpp scales Gemma-2 queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B);
        # HF by 1/sqrt(query_pre_attn_scalar). Any other value would run differently there.
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        scalar = config.get("query_pre_attn_scalar", 256)
        if scalar not in (head_dim, config["hidden_size"] // config["num_attention_heads"]):
            raise UserError(
                f"--format gguf: this Gemma-2 has query_pre_attn_scalar {scalar} but head_dim {head_dim}; llama.cpp "
                "scales attention by head_dim, so it would compute another model. Serve the merged folder instead"
            )
        for key, cap in gemma2_softcaps(config).items():
            if not cap:
                # llama.cpp's gemma2 always soft-caps, as cap * tanh(x / cap): a stored 0 zeroes the
                # attention scores (or the logits), an absent key means its default (50 / 30).
                raise UserError(
                    f"--format gguf: this Gemma-2 has {key} {json.dumps(config.get(key))} (no soft-capping); llama.cpp's gemma2 always "
                    "soft-caps, with no value that turns it off, so it would compute another model. Serve the merged folder instead"
                )
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "llama3", "linear"):
        raise UserError(
            f"--format gguf: rope scaling {rope.get('rope_type')!r} is not exported (default, llama3 and linear are); "
            "serve the merged folder (`lora-tune merge`) with vLLM or transformers instead"
        )
    if rope.get("rope_type") == "llama3" and not family.rotary_permute:
        raise UserError(f"--format gguf: llama3 rope scaling on a {model_type} model is not exported; serve the merged folder instead")
    return family


def gemma2_softcaps(config: dict) -> dict:
    """Gemma-2's attention and final-logit soft-caps as transformers runs the model: a key config.json
    lacks takes Gemma2Config's default (50 / 30), None turns the cap off."""
    defaults = Gemma2Config()
    return {key: config.get(key, getattr(defaults, key)) for key in ("attn_logit_softcapping", "final_logit_softcapping")}


def rope_parameters(config: dict) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs in `rope_theta` / `rope_scaling`."""
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in config:
        rope["rope_theta"] = config["rope_theta"]
    if config.get("rope_scaling"):
        rope = {**config["rope_scaling"], **rope}
        rope.setdefault("rope_type", config["rope_scaling"].get("rope_type") or config["rope_scaling"].get("type"))
    return rope


# --- tensors -------------------------------------------------------------------------------------
@dataclass
class PlannedGgufTensor:
    hf_name: str  # the name in the merged safetensors ("" for tensors we compute, e.g. rope_freqs)
    gguf_name: str
    shape: tuple[int, ...]  # torch order (rows first), after our layout transform
    qtype: object  # gguf.GGMLQuantizationType
    make: Callable[[], torch.Tensor] | None = None  # for computed tensors

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES  # noqa: PLC0415 - optional dependency (the [export] extra)

        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


def permute_rotary(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: HF's rotate-half rows -> GGML's interleaved rotary pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def tensor_type(quant: str, shape: tuple[int, ...], gguf_name: str):
    """ggml type for one tensor: 1-D -> F32; 2-D+ -> the requested type, falling back to F16 where
    rows don't split into Q8_0 blocks of 32 (what llama.cpp's converter does)."""
    from gguf import GGML_QUANT_SIZES  # noqa: PLC0415 - optional dependency (the [export] extra)
    from gguf import GGMLQuantizationType as Q  # noqa: PLC0415 - optional dependency (the [export] extra)

    if len(shape) < 2 or gguf_name == "rope_freqs.weight":
        return Q.F32
    qtype = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[quant]
    if shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return Q.F16
    return qtype


def llama3_rope_factors(config: dict) -> torch.Tensor:
    """llama.cpp's rope_freqs tensor for Llama-3.1-style rope scaling (LlamaModel.generate_extra_tensors)."""
    rope = rope_parameters(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def plan_tensors(config: dict, family: Family, source_tensors: list[tuple[str, list[int]]], quant: str) -> list[PlannedGgufTensor]:
    """GGUF names, shapes and types for every source tensor (from the safetensors headers alone).
    A tensor with no GGUF name is refused: writing a file that silently lacks it would be wrong."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    name_map = gguf.get_tensor_name_map(arch, config.get("num_hidden_layers") or config.get("n_layer"))
    tied = config.get("tie_word_embeddings", False)
    planned = []
    for hf_name, shape in source_tensors:
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp uses token_embd when output.weight is absent
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue  # buffers, not weights
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(
                f"--format gguf: tensor {hf_name} has no name in llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} layout; "
                "this checkpoint is not one llama.cpp can run. Serve the merged folder instead"
            )
        out_shape = tuple(reversed(shape)) if family.conv1d and is_conv1d(hf_name, shape) else tuple(shape)
        planned.append(PlannedGgufTensor(hf_name, gguf_name, out_shape, tensor_type(quant, out_shape, gguf_name)))
    if rope_parameters(config).get("rope_type") == "llama3":
        factors = llama3_rope_factors(config)
        planned.insert(
            0,
            PlannedGgufTensor(
                "",
                "rope_freqs.weight",
                tuple(factors.shape),
                tensor_type(quant, tuple(factors.shape), "rope_freqs.weight"),
                make=lambda: factors,
            ),
        )
    return planned


GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def is_conv1d(hf_name: str, shape: list[int]) -> bool:
    return hf_name.endswith(GPT2_CONV1D) and len(shape) == 2


def to_gguf_layout(t: PlannedGgufTensor, tensor: torch.Tensor, config: dict, family: Family) -> torch.Tensor:
    """One tensor (fp32, HF layout) -> llama.cpp's layout for it."""
    if family.rotary_permute and t.hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        tensor = permute_rotary(tensor, config["num_attention_heads"], config["num_attention_heads"])
    elif family.rotary_permute and t.hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        tensor = permute_rotary(tensor, config["num_attention_heads"], config.get("num_key_value_heads"))
    if family.norm_plus_one and t.hf_name.endswith("norm.weight"):
        tensor = tensor + 1
    if family.conv1d and is_conv1d(t.hf_name, list(tensor.shape)):
        tensor = tensor.T
    return tensor


def encode(t: PlannedGgufTensor, tensor: torch.Tensor) -> np.ndarray:
    """fp32 tensor -> the bytes of its ggml type (gguf's own quantizers)."""
    from gguf import GGMLQuantizationType as Q  # noqa: PLC0415 - optional dependency (the [export] extra)
    from gguf import quantize  # noqa: PLC0415 - optional dependency (the [export] extra)

    data = tensor.detach().to(torch.float32).contiguous().numpy()
    if t.qtype == Q.F32:
        return data
    if t.qtype == Q.F16:
        return data.astype(np.float16)
    return quantize(data, t.qtype)  # BF16 and Q8_0: uint8 blocks


# --- metadata ------------------------------------------------------------------------------------
def add_hyperparameters(writer, config: dict, family: Family, quant: str, name: str) -> None:
    """The keys llama.cpp reads for this architecture, as its converter writes them."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[
        quant
    ]
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if family.arch == "GPT2":
        writer.add_block_count(config["n_layer"])
        writer.add_context_length(config.get("n_ctx") or config["n_positions"])
        writer.add_embedding_length(config["n_embd"])
        writer.add_feed_forward_length(config.get("n_inner") or 4 * config["n_embd"])
        writer.add_head_count(config["n_head"])
        writer.add_layer_norm_eps(config["layer_norm_epsilon"])
        return
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    rope = rope_parameters(config)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if head_dim != hidden // heads or family.arch in ("GEMMA2", "QWEN3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family.arch == "LLAMA":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if family.arch == "PHI3":
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0
        writer.add_rope_dimension_count(int(factor * hidden) // heads)
    if family.arch == "GEMMA2":
        caps = gemma2_softcaps(config)  # never off here: family_of refuses that
        writer.add_attn_logit_softcapping(caps["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(caps["final_logit_softcapping"])
    if config.get("sliding_window") and family.arch in ("GEMMA2", "PHI3"):
        writer.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])


# llama.cpp's names for the pre-tokenizer regexes it implements (llama-vocab.cpp); the regex of each
# is read from transformers' own GGUF table, so the name we write is one its reader maps back.
PREFERRED_PRE_NAMES = ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35")


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level BPE tokenizer.json, or a UserError: a wrong
    name makes llama.cpp split text differently from training, silently."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space", False):
        return "gpt-2"  # ByteLevel's built-in split is GPT-2's regex
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        names = [n for n, r in GGUF_PRE_TOKENIZER_SPLITS.items() if r == regex]
        for name in PREFERRED_PRE_NAMES:
            if name in names:
                return name
        if names:
            return names[0]
    raise UserError(
        f"--format gguf: the tokenizer's pre-tokenizer ({', '.join(map(str, kinds))}) is not one llama.cpp implements by name, "
        "so it would split text differently from training; use the merged folder with transformers or vLLM"
    )


def add_tokenizer(writer, tokenizer_dir: Path, vocab_size: int) -> None:
    """Vocabulary, token types, merges, special token ids, add-BOS flag and chat template.

    Token types follow llama.cpp's converter (TextModel.get_vocab_base): ids the model has but the
    tokenizer doesn't are [PAD{i}] (UNUSED); added special tokens are CONTROL, other added tokens
    USER_DEFINED; everything else NORMAL."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"--format gguf: no tokenizer could be loaded from {tokenizer_dir} ({str(e).splitlines()[0]})") from None
    if not tokenizer.is_fast:
        raise UserError(f"--format gguf: the tokenizer in {tokenizer_dir} is not a fast (tokenizers) one; re-save it with transformers")
    # The pipeline as transformers runs it (a tokenizer class may rebuild it from vocab and merges,
    # whatever tokenizer.json says): that is what training saw.
    tokenizer_json = json.loads(tokenizer.backend_tokenizer.to_str())
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tokenizer_json.get("decoder") or {}).get("type") != "ByteLevel":
        raise UserError(
            f"--format gguf: the tokenizer in {tokenizer_dir} is a {model.get('type')} "
            f"tokenizer{' with byte fallback (SentencePiece-style)' if model.get('byte_fallback') else ''}; "
            "only byte-level BPE tokenizers (Llama-3, Qwen, GPT-2 style) are exported. Use llama.cpp's convert_hf_to_gguf.py "
            "on the merged folder"
        )
    pre = pre_tokenizer_name(tokenizer_json)
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    beyond = {i: t for i, t in reverse.items() if i >= vocab_size}
    if beyond:
        # The model has no embedding for them (llama.cpp's converter also stops at the model's vocab_size).
        log.warning(
            "export: tokenizer ids beyond the model's %d embeddings are left out: %s",
            vocab_size,
            ", ".join(f"{t!r} ({i})" for i, t in sorted(beyond.items())),
        )
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens))
    if special.chat_template is None and tokenizer.chat_template:
        special.chat_template = tokenizer.chat_template  # chat_template.jinja read through transformers
    special.add_to_gguf(writer, quiet=True)


# --- writing ---------------------------------------------------------------------------------------
def write(
    path: Path,
    config: dict,
    family: Family,
    planned: list[PlannedGgufTensor],
    produce: Callable[[PlannedGgufTensor], torch.Tensor],
    tokenizer_dir: Path,
    quant: str,
    name: str,
) -> None:
    """Header, metadata and tensor infos first, then each tensor's data as it is produced: peak
    memory is one tensor (and its encoded copy), not the model."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)])
    add_hyperparameters(writer, config, family, quant, name)
    add_tokenizer(writer, tokenizer_dir, config["vocab_size"])
    for t in planned:
        byte_shape = (
            gguf.quant_shape_to_byte_shape(t.shape, t.qtype)
            if t.qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            else t.shape
        )
        np_dtype = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(t.qtype, np.uint8)
        writer.add_tensor_info(
            t.gguf_name, byte_shape, np.dtype(np_dtype), t.nbytes, raw_dtype=None if np_dtype is not np.uint8 else t.qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in planned:
        tensor = t.make() if t.make is not None else to_gguf_layout(t, produce(t), config, family)
        if tuple(tensor.shape) != t.shape:
            raise RuntimeError(f"{t.hf_name}: produced {tuple(tensor.shape)}, planned {t.shape}")
        writer.write_tensor_data(encode(t, tensor))
        del tensor
    writer.close()
