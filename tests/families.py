"""Tiny random models of each family users bring, built with transformers' own config classes and
saved through save_pretrained (so loading goes through the real from_pretrained), with the tiny
BPE tokenizer. Shapes are the smallest that keep each family's quirks: GQA, fused projections
(Phi-3 qkv_proj/gate_up_proj, GPT-NeoX query_key_value), Conv1D (GPT-2), fused MoE experts and a
router (Mixtral), soft-capping and a template without a system role (Gemma-2)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from lora_tune.models.tiny.model import train_tiny_tokenizer

# Gemma's and Mistral's templates refuse a system turn (and insist on user/assistant alternation).
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}<user>{{ m['content'] }}\n{% else %}<bot>{% generation %}{{ m['content'] }}{{ eos_token }}{% "
    "endgeneration %}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
)

SMALL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256
)
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def family_configs(vocab: int) -> dict:

    return {
        "llama": LlamaConfig(vocab_size=vocab, **SMALL, **IDS),
        "qwen2": Qwen2Config(vocab_size=vocab, **SMALL, **IDS),
        "qwen3": Qwen3Config(vocab_size=vocab, head_dim=16, **SMALL, **IDS),
        "mistral": MistralConfig(vocab_size=vocab, **SMALL, **IDS),
        "mixtral": MixtralConfig(vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2, **SMALL, **IDS),
        "gemma2": Gemma2Config(vocab_size=vocab, head_dim=16, sliding_window=64, **SMALL, **IDS),
        "phi3": Phi3Config(vocab_size=vocab, **{**SMALL, "num_key_value_heads": 4}, **IDS),
        "gpt_neox": GPTNeoXConfig(vocab_size=vocab, **{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}, **IDS),
        "gpt2": GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256, **IDS),
    }


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma2", "phi3", "gpt_neox", "gpt2")
NO_SYSTEM_ROLE = ("mistral", "mixtral", "gemma2")

# What the default targets adapt in one block: every linear layer (fused ones whole), the MoE
# experts' fused tensors, never the router.
EXPECTED_TARGETS = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "qwen3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "mistral": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "mixtral": {"q_proj", "k_proj", "v_proj", "o_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"},
    "gemma2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},
}


def build_family(name: str, out: Path, seed: int = 0) -> Path:

    tokenizer = train_tiny_tokenizer()
    if name in NO_SYSTEM_ROLE:
        tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    config = family_configs(len(tokenizer))[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
