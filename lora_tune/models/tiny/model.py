"""Build a tiny Llama (2 layers, a BPE tokenizer trained on the spot, a chat template) offline, or a
tiny model of any other family.

It backs the `tiny-llama` alias used by the quick start and the tests, and the family sweep:
everything goes through the real `from_pretrained` path afterwards, only the weights are random and
small.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import CONFIG_MAPPING, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lora_tune.models.structure import auto_class
from lora_tune.models.tiny.configs import shrink_config

# A Llama-3-style template: every assistant turn ends with the EOS token, so a model trained on it
# learns to stop. It is the template `tiny-llama` ships with.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Qwen2.5's own template (tools in the system turn, calls as <tool_call>{json}</tool_call>, results as
# <tool_response> in a user turn), byte for byte, so that tools and TRL's response parsing see a
# template they know: the tiny model of agentic RL (build_tiny_llama(tools=True)).
TOOL_CHAT_TEMPLATE = (Path(__file__).parent / "qwen2_5_chat.jinja").read_text()
TOOL_TOKENS = ("<|im_start|>", "<|im_end|>")  # special: a turn's start and end (EOS)
TOOL_WORDS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # added, not special: decoded as text

_CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:",
    "### Input:",
    "### Response:",
    "### System:",
    "### User:",
    "### Assistant:",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Translate to French: good morning. Bonjour.",
    "Add two numbers: 2 and 3. The answer is 5.",
    "Name a primary colour. Red, blue and yellow are primary colours.",
    "List three fruits. Apple, banana and cherry.",
    "0 1 2 3 4 5 6 7 8 9 ten eleven twelve hundred thousand",
    "user assistant system hello world question answer summary story poem code python",
]


_TOOL_CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:",
    '{"name": <function-name>, "arguments": <args-json-object>}',
    '{"type": "function", "function": {"name": "calculator", "description": "", "parameters": {"type": "object", "properties": '
    '{"expression": {"type": "string", "description": ""}}, "required": ["expression"]}, "return": {"type": "string"}}}',
    "<tool_response>\n</tool_response> What is the answer? Use the calculator for arithmetic, then answer with the number.",
]


def train_tiny_tokenizer(vocab_size: int = 512, extra_special_tokens: dict[str, str] | None = None, tools: bool = False):
    """A byte-level BPE tokenizer with <s>, </s>, <pad>, trained on a fixed corpus (deterministic).
    `extra_special_tokens` (name -> token, e.g. image_token): added after the vocabulary, in order,
    and named on the tokenizer (`tokenizer.image_token`, `.image_token_id`) as image-text families' are.
    `tools`: Qwen2.5's chat template and turn tokens, <|im_end|> the EOS (as Qwen's instruct models)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # With tools, the template's own boilerplate is in the corpus too, so that a prompt with tools stays
    # a few hundred tokens rather than a thousand.
    corpus = _CORPUS + (_TOOL_CORPUS if tools else [])
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Like Llama, BOS is prepended by the tokenizer itself; EOS is appended by the data stage.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    named = dict(extra_special_tokens or {})
    if named:
        tok.add_special_tokens(list(named.values()))
    if tools:
        tok.add_special_tokens(list(TOOL_TOKENS))
        tok.add_tokens(list(TOOL_WORDS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token=TOOL_TOKENS[1] if tools else "</s>",
        pad_token="<pad>",
        **({"extra_special_tokens": named} if named else {}),
    )
    fast.chat_template = TOOL_CHAT_TEMPLATE if tools else TINY_CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, **overrides):
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_tiny_llama(out_dir: str | Path, seed: int = 0, with_chat_template: bool = True, tools: bool = False, **config_overrides) -> Path:
    """Write a loadable tiny Llama (safetensors weights + tokenizer) to `out_dir` and return it;
    `tools`: with Qwen2.5's tool-calling chat template (train_tiny_tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(tools=tools)
    if not with_chat_template:
        tokenizer.chat_template = None
    eos = tokenizer.eos_token_id
    config = tiny_llama_config(len(tokenizer), **{"eos_token_id": eos, **config_overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos, "pad_token_id": 0}))
    return out


# Tiny models of other families are refused above this size: a tower the shrinking rules can't
# narrow must not be allocated (it would take the host's memory, not a tiny model's).
MAX_TINY_PARAMS = 30_000_000


def build_tiny_model(model_type: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random model of any family transformers implements (its default config, shrunk by
    `tiny_configs.shrink_config`: same layer kinds, 64 wide), saved from the class its real
    checkpoints are saved from (image-text wrappers included), with the tiny tokenizer. Sized on
    the meta device first; ValueError above MAX_TINY_PARAMS."""
    config = shrink_config(CONFIG_MAPPING[model_type]())
    with torch.device("meta"):
        n = sum(p.numel() for p in auto_class(config).from_config(config).parameters())
    if n > MAX_TINY_PARAMS:
        raise ValueError(f"a shrunk {model_type} still has {n / 1e6:.0f}M parameters (limit {MAX_TINY_PARAMS / 1e6:.0f}M)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    auto_class(config).from_config(config).save_pretrained(out)
    train_tiny_tokenizer().save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return out
