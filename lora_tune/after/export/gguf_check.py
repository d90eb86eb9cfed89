"""A written GGUF read back before it is put in place: gguf's reader (tensors, shapes, types,
metadata), the tokenizer rebuilt from it, and logits through transformers' GGUF loader against the
merged model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.utils import logging as hf_logging

from lora_tune.after.export.gguf import Family, PlannedGgufTensor
from lora_tune.errors import UserError

# Round-trip acceptance: f16/bf16 logits within 1e-2 relative to the merged model's; q8_0 within 5e-2
# (a layout or name mistake gives O(1)) and the same greedy next token on >= 99% of the positions where
# the merged model is confident: its top logit leads the runner-up by CONFIDENT_MARGIN of its largest
# logit. Where it is not (an undertrained or tiny model's near-flat logits), q8_0's rounding flips
# near-ties legitimately: a random tiny Llama agreed on 98.3% of all positions, on 100% of the 75% it
# was confident at.
LOGITS_TOLERANCE = {"f16": 1e-2, "bf16": 1e-2, "q8_0": 5e-2}


GREEDY_AGREEMENT_MIN = 0.99
CONFIDENT_MARGIN = 0.02
UNCHECKED = "nothing was kept. --no-verify writes the file without this check"


FULL_CHECK_MAX_PARAMS = 100_000_000  # as `merge`: above this, the logits check would hold two models in RAM


FIXED_TEXT = "The quick brown fox jumps over the lazy dog. What is the capital of France? 0 1 2 3 hello world\n### Response:"


# --- verification ----------------------------------------------------------------------------------
@dataclass
class RoundTrip:
    """What reading the file back showed."""

    tensors: int
    max_abs_logit_diff: float | None = None
    max_rel_logit_diff: float | None = None
    greedy_agreement: float | None = None  # over every position
    confident_agreement: float | None = None  # over the positions where the merged model is confident
    confident_positions: int = 0
    token_ids_equal: bool | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # writing (merge included for a run), verification excluded
    path: Path | None = None


def check_file(path: Path, planned: list[PlannedGgufTensor], config: dict, family: Family) -> None:
    """gguf's reader: every tensor there with the planned name, shape and type, and the metadata llama.cpp needs."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    reader = gguf.GGUFReader(path)
    got = {t.name: t for t in reader.tensors}
    if len(got) != len(planned):
        raise UserError(
            f"verification failed: {path.name} holds {len(got)} tensors, {len(planned)} were written; nothing was kept", exit_code=1
        )
    for t in planned:
        r = got.get(t.gguf_name)
        if r is None or tuple(int(d) for d in reversed(r.shape)) != t.shape or r.tensor_type != t.qtype:
            raise UserError(
                f"verification failed: tensor {t.gguf_name} reads back as "
                f"{None if r is None else (tuple(reversed(r.shape.tolist())), r.tensor_type.name)}, "
                f"written {t.shape} {t.qtype.name}; nothing was kept",
                exit_code=1,
            )
    arch = reader.fields["general.architecture"].contents()
    if arch != gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)]:
        raise UserError(f"verification failed: general.architecture reads back as {arch!r}", exit_code=1)
    for key in ("block_count", "embedding_length"):
        if f"{arch}.{key}" not in reader.fields:
            raise UserError(f"verification failed: {arch}.{key} missing from the metadata", exit_code=1)


def check_tokenizer(path: Path, tokenizer_dir: Path) -> bool:
    """The tokenizer transformers rebuilds from the GGUF's metadata encodes a fixed text to the same
    ids as the original, and knows the same BOS/EOS and chat template."""
    original = AutoTokenizer.from_pretrained(tokenizer_dir)
    rebuilt = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    want = original(FIXED_TEXT, add_special_tokens=False)["input_ids"]
    got = rebuilt(FIXED_TEXT, add_special_tokens=False)["input_ids"]
    same = want == got and rebuilt.eos_token_id == original.eos_token_id and rebuilt.bos_token_id == original.bos_token_id
    if original.chat_template:
        same = same and rebuilt.chat_template == original.chat_template
    return same


# Natural text, not random ids: a trained model is confident on text, and greedy agreement is only
# meaningful where it is (on random ids, near-ties flip under any rounding).
VERIFY_TEXTS = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request. "
    "### Instruction: Name a primary colour. ### Response: Red, blue and yellow are primary colours. "
    "### Instruction: List three fruits. ### Response: Apple, banana and cherry.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. What is the capital of France? "
    "The capital of France is Paris. Translate to French: good morning. Bonjour. Add two numbers: 2 and 3. The answer is 5.",
    "### User: Translate to French: good morning. ### Assistant: Bonjour. ### User: Add two numbers: 2 and 3. "
    "### Assistant: The answer is 5. ### User: What is the capital of France? ### Assistant: The capital of France is Paris.",
    "List three fruits. Apple, banana and cherry. 0 1 2 3 4 5 6 7 8 9 ten eleven twelve hundred thousand. "
    "hello world question answer summary story poem code python. Name a primary colour. Red, blue and yellow are primary colours.",
)


def fixed_prompts(tokenizer_dir: Path, vocab: int, length: int = 64) -> torch.Tensor:
    """4 x up to 64 token ids of VERIFY_TEXTS (BOS as the tokenizer adds it): 256 positions, so 99%
    greedy agreement tolerates 2 flips."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [tokenizer(text)["input_ids"] for text in VERIFY_TEXTS]
    length = min(length, *map(len, rows))
    ids = torch.tensor([row[:length] for row in rows])
    return ids.clamp_max(vocab - 1)


# Config fields transformers' GGUF reader may leave at its class defaults for some architectures (its
# GGUF_CONFIG_MAPPING has no key for them there: qwen3's head_dim, gpt2's n_positions, rope scaling).
READER_GAPS = (
    "head_dim",
    "n_positions",
    "rope_parameters",
    "partial_rotary_factor",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
)


def reading_config(path: Path, source_config: dict):
    """The config transformers rebuilds from the file's metadata, with the fields its GGUF mapping
    does not carry for this architecture filled from the source (named in the notes). A field it
    does map that reads back different is our metadata's fault: verification fails."""
    import gguf  # noqa: PLC0415 - optional dependency (the [export] extra)

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    mapped = {v for v in GGUF_CONFIG_MAPPING.get(arch, {}).values() if v}
    filled = []
    for key in READER_GAPS:
        want, have = source_config.get(key), getattr(config, key, None)
        if want is None or want == have:
            continue
        if key in mapped:
            raise UserError(
                f"verification failed: {key} reads back from the GGUF as {have}, the model has {want}; nothing was kept", exit_code=1
            )
        setattr(config, key, want)
        filled.append(key)
    theta = (source_config.get("rope_parameters") or {}).get("rope_theta", source_config.get("rope_theta"))
    if theta is not None and (config.rope_parameters or {}).get("rope_theta") != theta:
        raise UserError(
            f"verification failed: rope_theta reads back as {(config.rope_parameters or {}).get('rope_theta')}, the model has "
            f"{theta}; nothing was kept",
            exit_code=1,
        )
    return config, filled


def gguf_logits(path: Path, ids: torch.Tensor, config_override=None) -> torch.Tensor:
    """Logits of the file as transformers' GGUF loader reads it: an independent reader of names,
    layouts (it reverses the rotary permutation and norm offsets itself) and metadata."""
    hf_logging.disable_progress_bar()
    kwargs = {"config": config_override} if config_override is not None else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def compare(got: torch.Tensor, want: torch.Tensor, quant: str, result: RoundTrip) -> None:
    diff = (got - want).abs().max()
    scale = want.abs().max().clamp_min(1e-12)
    result.max_abs_logit_diff = float(diff)
    result.max_rel_logit_diff = float(diff / scale)
    agree = got.argmax(-1) == want.argmax(-1)
    result.greedy_agreement = float(agree.float().mean())
    top = want.topk(2, dim=-1).values
    confident = (top[..., 0] - top[..., 1]) >= CONFIDENT_MARGIN * scale
    result.confident_positions = int(confident.sum())
    result.confident_agreement = float(agree[confident].float().mean()) if result.confident_positions else None
    if quant in LOGITS_TOLERANCE and not result.max_rel_logit_diff <= LOGITS_TOLERANCE[quant]:
        raise UserError(
            f"verification failed: the GGUF's logits drift {result.max_rel_logit_diff:.2e} (relative) from the merged model's "
            f"(tolerance {LOGITS_TOLERANCE[quant]:.0e} for {quant}); {UNCHECKED}",
            exit_code=1,
        )
    if quant == "q8_0" and result.confident_positions and not result.confident_agreement >= GREEDY_AGREEMENT_MIN:
        raise UserError(
            f"verification failed: the q8_0 GGUF agrees with the merged model's greedy token on {result.confident_agreement:.1%} of "
            f"the {result.confident_positions} positions where the merged model is confident (needed {GREEDY_AGREEMENT_MIN:.0%}); "
            f"{UNCHECKED}",
            exit_code=1,
        )
