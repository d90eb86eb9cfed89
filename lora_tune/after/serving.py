"""Will this adapter serve? `lora-tune check-serving RUN_DIR --engine vllm|llama.cpp|ollama`, and the
same rules before training with `--serve-with` (`check_config`), so nobody finds out in production.

Each rule names its source. Engines refuse some adapters at load time and - worse - accept some and
ignore them: vLLM loads LoRA on fused MoE expert tensors (peft `target_parameters`) as a silent
no-op, so the served model is the base. For those the answer is: merge, then serve the merged model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from lora_tune.after.merge.reading import read_adapter
from lora_tune.errors import UserError
from lora_tune.models.aliases import ALIASES, architecture

log = logging.getLogger("lora_tune")

ENGINES = ("vllm", "llama.cpp", "ollama")
# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py, MaxLoRARanks); its default is 16.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DEFAULT_MAX_LORA_RANK = 16
EMBEDDING_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")
# Families whose LoRA a llama.cpp adapter GGUF can carry: the architectures `lora-tune export`
# writes (lora_tune.after.export.gguf.FAMILIES) - an adapter GGUF must match its base's tensor layout.
LLAMA_CPP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2")
# Ollama's ADAPTER takes safetensors (PEFT) adapters for these families only; others need a GGUF
# adapter (docs/import.md, "Importing a fine tuned adapter from Safetensors weights").
OLLAMA_SAFETENSORS_FAMILIES = ("llama", "mistral", "mixtral", "gemma", "gemma2")


@dataclass
class AdapterFacts:
    """What the engines look at, from a saved adapter_config.json or from the training options."""

    rank: int
    dora: bool = False
    modules_to_save: list[str] = field(default_factory=list)
    bias: str = "none"
    target_modules: list[str] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)
    has_patterns: bool = False  # rank_pattern / alpha_pattern
    model_type: str = ""
    at_train_time: bool = False  # messages name flags instead of adapter fields

    @classmethod
    def from_adapter_config(cls, config: dict, model_type: str) -> AdapterFacts:
        ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
        targets = config.get("target_modules") or []
        return cls(
            rank=max(ranks),
            dora=bool(config.get("use_dora")),
            modules_to_save=list(config.get("modules_to_save") or []),
            bias=config.get("bias") or "none",
            target_modules=[targets] if isinstance(targets, str) else list(targets),
            target_parameters=list(config.get("target_parameters") or []),
            has_patterns=bool(config.get("rank_pattern") or config.get("alpha_pattern")),
            model_type=model_type,
        )

    @classmethod
    def from_train(cls, cfg, targets, model_type: str) -> AdapterFacts:
        return cls(
            rank=cfg.rank,
            dora=cfg.dora,
            target_modules=list(targets.modules) if targets else list(cfg.target_modules or []),
            target_parameters=list(targets.parameters) if targets else [],
            model_type=model_type,
            at_train_time=True,
        )


def _merge_then_serve(facts: AdapterFacts) -> str:
    return (
        "train without them (--target-modules listing only linear layers) or merge (`lora-tune merge`) and serve the merged model"
        if facts.at_train_time
        else "merge (`lora-tune merge`), then serve the merged model"
    )


def vllm_problems(facts: AdapterFacts) -> list[str]:
    problems = []
    # vllm/lora/peft_helper.py, PEFTHelper._validate_features: "vLLM does not yet support DoRA."
    if facts.dora:
        problems.append(
            "vLLM refuses DoRA adapters (peft_helper: 'vLLM does not yet support DoRA'); "
            + ("drop --dora" if facts.at_train_time else "merge, then serve the merged model")
        )
    # same place: "vLLM only supports modules_to_save being None."
    if facts.modules_to_save:
        problems.append(
            f"vLLM refuses modules_to_save ({', '.join(facts.modules_to_save)}) (peft_helper: 'only supports modules_to_save "
            "being None'); merge, then serve the merged model"
        )
    # PEFTHelper.validate_legal: "Adapter bias cannot be used without bias_enabled"; lora-tune never trains biases.
    if facts.bias != "none":
        problems.append(
            f"vLLM refuses LoRA bias ({facts.bias}) unless the server enables it (--enable-lora-bias, removed in recent vLLM); "
            "merge, then serve the merged model"
        )
    # validate_legal: r must be <= max_lora_rank, which takes one of VLLM_MAX_LORA_RANKS.
    if facts.rank > max(VLLM_MAX_LORA_RANKS):
        problems.append(
            f"rank {facts.rank} is above vLLM's largest --max-lora-rank ({max(VLLM_MAX_LORA_RANKS)}); "
            + ("use --rank 512 or less" if facts.at_train_time else "merge, then serve the merged model")
        )
    # vLLM LoRA applies to linear layers; embedding / output-head targets need the extra-vocab path
    # that recent vLLM removed (issue 22 and the field notes: "embedding/head targets").
    embedded = [t for t in facts.target_modules if t in EMBEDDING_TARGETS]
    if embedded:
        problems.append(f"vLLM does not serve LoRA on {', '.join(embedded)} (embedding / output head); merge, then serve the merged model")
    # vLLM PR #41384: adapters on fused MoE expert tensors (peft target_parameters) were loaded as a
    # silent no-op - the served model behaves like the base.
    if facts.target_parameters:
        problems.append(
            f"vLLM loads LoRA on fused expert tensors ({', '.join(facts.target_parameters)}) as a silent no-op (vLLM PR #41384): "
            f"the served model would be the base; {_merge_then_serve(facts)}"
        )
    # PEFTHelper.from_dict keeps only the fields it declares (r, lora_alpha, target_modules, ...):
    # rank_pattern / alpha_pattern are dropped, so those modules get the global alpha / r scale.
    if facts.has_patterns:
        problems.append(
            "vLLM drops rank_pattern / alpha_pattern (PEFTHelper.from_dict keeps only its own fields), so those modules would "
            "be scaled by the global alpha / r; merge, then serve the merged model"
        )
    return problems


def llama_cpp_problems(facts: AdapterFacts) -> list[str]:
    """A llama.cpp LoRA GGUF holds `.lora_a` / `.lora_b` pairs per weight and one alpha (llama.cpp's
    convert_lora_to_gguf.py and llama-adapter.cpp): nothing else can travel in it."""
    problems = []
    if facts.model_type not in LLAMA_CPP_FAMILIES:
        problems.append(
            f"{facts.model_type or 'this'} models have no llama.cpp LoRA export here (exported: "
            f"{', '.join(LLAMA_CPP_FAMILIES)}); merge, then serve the merged model"
        )
    if facts.dora:
        problems.append(
            "a llama.cpp LoRA adapter has no DoRA magnitudes; "
            + ("drop --dora" if facts.at_train_time else "export the merged model instead (`lora-tune export RUN_DIR --format gguf`)")
        )
    if facts.modules_to_save:
        problems.append(
            f"a llama.cpp LoRA adapter can't carry modules_to_save ({', '.join(facts.modules_to_save)}); export the merged "
            "model instead (`--format gguf`)"
        )
    if facts.bias != "none":
        problems.append("a llama.cpp LoRA adapter has no LoRA bias; export the merged model instead (`--format gguf`)")
    if facts.target_parameters:
        problems.append(
            f"a llama.cpp LoRA adapter can't carry fused expert tensors ({', '.join(facts.target_parameters)}); {_merge_then_serve(facts)}"
        )
    embedded = [t for t in facts.target_modules if t in EMBEDDING_TARGETS]
    if embedded:
        problems.append(
            f"LoRA on {', '.join(embedded)} is not exported as a llama.cpp adapter; export the merged model instead (`--format gguf`)"
        )
    return problems


def ollama_problems(facts: AdapterFacts) -> list[str]:
    """Ollama's ADAPTER runs llama.cpp's LoRA: the same limits, plus which families it imports from
    safetensors (for the others, `lora-tune export --format gguf-lora` makes the GGUF adapter)."""
    return llama_cpp_problems(facts)


def problems_for(engine: str, facts: AdapterFacts) -> list[str]:
    return {"vllm": vllm_problems, "llama.cpp": llama_cpp_problems, "ollama": ollama_problems}[engine](facts)


def vllm_max_lora_rank(rank: int) -> int:
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)


def how_to_serve(engine: str, facts: AdapterFacts, base: str, adapter_dir: str) -> str:
    if engine == "vllm":
        needed = vllm_max_lora_rank(facts.rank)
        rank_flag = f" --max-lora-rank {needed}" if needed > VLLM_DEFAULT_MAX_LORA_RANK else ""
        return f"vllm serve {base} --enable-lora --lora-modules adapter={adapter_dir}{rank_flag}"
    if engine == "llama.cpp":
        return (
            f"lora-tune export {adapter_dir} --format gguf-lora --output adapter.gguf, then llama-server -m BASE.gguf --lora adapter.gguf "
            "(BASE.gguf: `lora-tune export` of the base)"
        )
    if facts.model_type in OLLAMA_SAFETENSORS_FAMILIES:
        return (
            f"a Modelfile with FROM <the base> and ADAPTER {adapter_dir} (Ollama imports safetensors adapters for this family), "
            "then `ollama create`"
        )
    return (
        f"lora-tune export {adapter_dir} --format gguf-lora --output adapter.gguf, and a Modelfile with FROM <the base as GGUF> "
        "and ADAPTER ./adapter.gguf"
    )


def check_config(cfg, targets, model_type: str) -> None:
    """Training-time check for `--serve-with ENGINE`: the options that would make the adapter
    unservable there are refused in one line, before loading, with what to do instead. `targets`
    is lora_tune.models.targets.Targets as resolved for the run (None: only the options are checked)."""
    engine = getattr(cfg, "serve_with", None)
    if not engine:
        return
    problems = problems_for(engine, AdapterFacts.from_train(cfg, targets, model_type))
    if problems:
        raise UserError(f"--serve-with {engine}: " + "; ".join(problems))
    if engine == "vllm" and vllm_max_lora_rank(cfg.rank) > VLLM_DEFAULT_MAX_LORA_RANK:
        log.info("--serve-with vllm: rank %d needs vLLM started with --max-lora-rank %d", cfg.rank, vllm_max_lora_rank(cfg.rank))


@dataclass
class ServingReport:
    engine: str
    problems: list[str]
    command: str | None  # how to serve it, when it serves


def run(cfg) -> ServingReport:
    """`lora-tune check-serving RUN_DIR --engine E`: reads adapter_config.json (and the base's
    config.json for the family), nothing heavy. Refusals are one `error:` line (exit 2)."""
    folder = Path(cfg.source).expanduser()
    adapter_config, weights = read_adapter(folder)
    base = cfg.base or adapter_config.get("base_model_name_or_path") or ""
    facts = AdapterFacts.from_adapter_config(adapter_config, base_model_type(base))
    # The weights say what the config may not: DoRA magnitudes, trained copies (modules_to_save).
    facts.dora = facts.dora or any("lora_magnitude_vector" in k for k in weights)
    problems = problems_for(cfg.engine, facts)
    if problems:
        raise UserError(f"check-serving {cfg.engine}: " + "; ".join(problems))
    command = how_to_serve(cfg.engine, facts, base, str(folder))
    print(f"{cfg.engine}: this adapter serves (rank {facts.rank}, {', '.join(facts.target_modules)})")
    print(f"serve it with: {command}")
    return ServingReport(cfg.engine, [], command)


def base_model_type(base: str) -> str:
    """model_type of the base, from its config.json (aliases ship theirs); '' when unknown offline."""
    if base in ALIASES:
        return architecture(base).get("model_type", "")
    config = Path(base).expanduser() / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type", "")
    return ""  # a hub id offline: the family rules can't be applied (llama.cpp/ollama say so)
