"""Will this adapter serve? `lora-tune check-serving RUN_DIR --engine vllm|llama.cpp|ollama`, and the
same rules before training with `--serve-with` (`check_config`), so nobody finds out in production.

Each rule names its source. Engines refuse some adapters at load time and - worse - accept some and
ignore them: vLLM loads LoRA on fused MoE expert tensors (peft `target_parameters`) as a silent
no-op, so the served model is the base, and on an image-text model it adapts the language model only,
ignoring LoRA on the vision tower and projector. For those the answer is: merge, then serve the
merged model. A merged folder is checked too (`check_merged`): what the engine reads besides the
weights (an image-text model's processor files).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from lora_tune.after import live_serving, vision
from lora_tune.after.merge.reading import latest_adapter, read_adapter
from lora_tune.errors import UserError, first_line
from lora_tune.models import shards
from lora_tune.models.aliases import ALIASES, architecture
from lora_tune.models.inits import changes_base
from lora_tune.training.generation.vllm_api import VLLM_DEFAULT_MAX_LORA_RANK, VLLM_MAX_LORA_RANKS, vllm_max_lora_rank

log = logging.getLogger("lora_tune")

ENGINES = ("vllm", "llama.cpp", "ollama")
EMBEDDING_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")
# Families whose LoRA a llama.cpp adapter GGUF can carry: the architectures `lora-tune export`
# writes (lora_tune.after.export.gguf.FAMILIES) - an adapter GGUF must match its base's tensor layout.
LLAMA_CPP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2")
# Ollama's ADAPTER imports a safetensors (PEFT) adapter through its own converter (convert/convert.go,
# ConvertAdapter): only onto a base whose GGUF architecture is llama (Llama, Mistral, Mixtral) or gemma2
# ("unsupported architecture" otherwise); it reads `lora_alpha` as an unsigned integer (a JSON 16.0 fails
# to parse) and writes one alpha, applied as alpha / r. Anything else goes as a GGUF adapter
# (`export --format gguf-lora`, which folds each module's own scale into B) or as the merged model.
OLLAMA_SAFETENSORS_FAMILIES = ("llama", "mistral", "mixtral", "gemma2")


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
    alpha: float | int | None = None  # lora_alpha as adapter_config.json holds it (16 and 16.0 differ to Ollama)
    rslora: bool = False
    alpha_pattern: bool = False
    model_type: str = ""
    at_train_time: bool = False  # messages name flags instead of adapter fields
    # An image-text base: the modules outside its language model (vision tower, projector) the adapter
    # changes (from the adapter's tensors); at train time, ["--train-vision"] when that is asked for.
    vision_modules: list[str] = field(default_factory=list)
    trainable_tokens: bool = False  # peft's trainable_token_indices: embedding rows trained in place
    peft_type: str = "LORA"  # another adapter type (OFT, LoHa, ...): servers that load adapters take LoRA only

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
            alpha=config.get("lora_alpha"),
            rslora=bool(config.get("use_rslora")),
            alpha_pattern=bool(config.get("alpha_pattern")),
            model_type=model_type,
            trainable_tokens=bool(config.get("trainable_token_indices")),
            peft_type=str(config.get("peft_type") or "LORA"),
        )

    @classmethod
    def from_train(cls, cfg, targets, model_type: str) -> AdapterFacts:
        return cls(
            # PiSSA / OLoRA adapters are written as rank-2r LoRAs of the original base (lora_tune.models.inits)
            rank=max([cfg.rank, *getattr(cfg, "rank_patterns", {}).values()])
            * (2 if changes_base(getattr(cfg, "init_lora_weights", None)) else 1),
            dora=cfg.dora,
            modules_to_save=list(getattr(cfg, "modules_to_save", None) or []),
            has_patterns=bool(getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None)),
            alpha_pattern=bool(getattr(cfg, "alpha_pattern", None)),
            trainable_tokens=bool(getattr(cfg, "trainable_tokens", None)),
            peft_type=getattr(cfg, "peft_type", "lora").upper(),
            target_modules=list(targets.modules) if targets else list(cfg.target_modules or []),
            target_parameters=list(targets.parameters) if targets else [],
            model_type=model_type,
            at_train_time=True,
            vision_modules=["--train-vision"]
            if getattr(cfg, "train_vision", False) and vision.is_image_text({"model_type": model_type})
            else [],
        )


def _named(modules: list[str]) -> str:
    return f"{modules[0]}" + (f" and {len(modules) - 1} more" if len(modules) > 1 else "")


def _vision(facts: AdapterFacts) -> str:
    if facts.at_train_time:
        return "--train-vision adapts the vision tower / projector"
    return f"this adapter changes {len(facts.vision_modules)} modules of the vision tower / projector ({_named(facts.vision_modules)})"


def _merge_then_serve(facts: AdapterFacts) -> str:
    return (
        "train without them (--target-modules listing only linear layers) or merge (`lora-tune merge`) and serve the merged model"
        if facts.at_train_time
        else "merge (`lora-tune merge`), then serve the merged model"
    )


def _tokens(server: str, facts: AdapterFacts) -> str:
    where = "--trainable-tokens trains" if facts.at_train_time else "this adapter holds"
    return f"{server} takes LoRA pairs only, and {where} embedding rows (peft's trainable_token_indices); merge first (`lora-tune merge`)"


def _not_lora(server: str, facts: AdapterFacts) -> str:
    return f"{server} serves LoRA adapters only, not {facts.peft_type}: merge first (`lora-tune merge`), then serve the merged model"


def vllm_problems(facts: AdapterFacts) -> list[str]:
    if facts.peft_type != "LORA":  # vllm/lora/peft_helper.py reads LoRA configs only
        return [_not_lora("vLLM", facts)]
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
    if facts.trainable_tokens:  # PEFTHelper reads LoRA pairs and embeddings only: the trained rows would be dropped
        problems.append(_tokens("vLLM", facts))
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
    # vllm/lora/model_manager.py: on a multimodal model, a LoRA module of the tower or connector
    # (get_mm_mapping) is skipped with "vLLM currently only supports adding LoRA to language model, X
    # will be ignored"; the experimental --enable-tower-connector-lora (recent vLLM, some models) lifts it.
    if facts.vision_modules:
        problems.append(
            f"vLLM's LoRA applies to an image-text model's language model only and ignores LoRA on its vision tower / projector "
            f"(model_manager: 'only supports adding LoRA to language model, ... will be ignored'): {_vision(facts)}, which would be "
            f"served as the base's; "
            + ("drop --train-vision" if facts.at_train_time else "merge (`lora-tune merge`), then serve the merged model")
            + " (or try vLLM's experimental --enable-tower-connector-lora, where the model supports it)"
        )
    # PEFTHelper.from_dict keeps only the fields it declares (r, lora_alpha, target_modules, ...):
    # rank_pattern / alpha_pattern are dropped, so those modules get the global alpha / r scale.
    if facts.has_patterns:
        problems.append(
            "vLLM drops rank_pattern / alpha_pattern (PEFTHelper.from_dict keeps only its own fields), so those modules would "
            "be scaled by the global alpha / r; merge, then serve the merged model"
        )
    return problems


def llama_cpp_problems(facts: AdapterFacts, merged_format: str = "gguf") -> list[str]:
    """A llama.cpp LoRA GGUF holds `.lora_a` / `.lora_b` pairs per weight and one alpha (llama.cpp's
    convert_lora_to_gguf.py and llama-adapter.cpp): nothing else can travel in it. The alternative is
    the merged model, exported as `merged_format`."""
    if facts.peft_type != "LORA":  # convert_lora_to_gguf.py converts LoRA adapters only
        return [_not_lora("llama.cpp", facts)]
    problems = []
    merged = f"export the merged model instead (`lora-tune export RUN_DIR --format {merged_format}`)"
    if facts.model_type not in LLAMA_CPP_FAMILIES:
        problems.append(
            f"{facts.model_type or 'this'} models have no llama.cpp LoRA export here (exported: "
            f"{', '.join(LLAMA_CPP_FAMILIES)}); merge, then serve the merged model"
        )
    if facts.dora:
        problems.append("a llama.cpp LoRA adapter has no DoRA magnitudes; " + ("drop --dora" if facts.at_train_time else merged))
    if facts.modules_to_save:
        problems.append(f"a llama.cpp LoRA adapter can't carry modules_to_save ({', '.join(facts.modules_to_save)}); {merged}")
    if facts.bias != "none":
        problems.append(f"a llama.cpp LoRA adapter has no LoRA bias; {merged}")
    if facts.trainable_tokens:
        problems.append(_tokens("a llama.cpp LoRA adapter", facts))
    if facts.target_parameters:
        problems.append(
            f"a llama.cpp LoRA adapter can't carry fused expert tensors ({', '.join(facts.target_parameters)}); {_merge_then_serve(facts)}"
        )
    embedded = [t for t in facts.target_modules if t in EMBEDDING_TARGETS]
    if embedded:
        problems.append(f"LoRA on {', '.join(embedded)} is not exported as a llama.cpp adapter; {merged}")
    # llama.cpp keeps an image-text model's vision tower and projector in a separate mmproj GGUF, which
    # takes no LoRA (llama-adapter.cpp applies adapters to the language model's tensors).
    if facts.vision_modules:
        problems.append(
            f"a llama.cpp LoRA adapter applies to the language model only, never to the vision projector (mmproj) file: {_vision(facts)}; "
            + (
                "drop --train-vision"
                if facts.at_train_time
                else "merge, and make the mmproj from the merged model (llama.cpp's convert_hf_to_gguf.py --mmproj)"
            )
        )
    return problems


def ollama_problems(facts: AdapterFacts) -> list[str]:
    """Ollama's ADAPTER runs llama.cpp's LoRA: the same limits (a DoRA adapter has no adapter form
    there), with the merged model as an Ollama folder (`export --format ollama`) the alternative."""
    return llama_cpp_problems(facts, merged_format="ollama")


def ollama_import_problems(facts: AdapterFacts) -> list[str]:
    """Why Ollama's own import of this safetensors adapter (ADAPTER <folder>) would fail or apply it at
    the wrong scale (see OLLAMA_SAFETENSORS_FAMILIES)."""
    reasons = []
    if facts.model_type not in OLLAMA_SAFETENSORS_FAMILIES:
        reasons.append(f"Ollama imports safetensors adapters onto {', '.join(OLLAMA_SAFETENSORS_FAMILIES)} bases only")
    if not isinstance(facts.alpha, int) or isinstance(facts.alpha, bool):
        reasons.append(f"lora_alpha is {facts.alpha!r} in adapter_config.json, and Ollama's converter reads it as an unsigned integer")
    if facts.rslora:
        reasons.append("it is rsLoRA (scaled alpha / sqrt(r)) and Ollama applies alpha / r")
    if facts.alpha_pattern:
        reasons.append("alpha_pattern gives some modules their own alpha and Ollama applies one")
    return reasons


def problems_for(engine: str, facts: AdapterFacts) -> list[str]:
    return {"vllm": vllm_problems, "llama.cpp": llama_cpp_problems, "ollama": ollama_problems}[engine](facts)


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
    unfit = ollama_import_problems(facts)
    if not unfit:
        return (
            f"a Modelfile with FROM <the base> and ADAPTER {adapter_dir} (Ollama imports safetensors adapters for this family), "
            "then `ollama create`"
        )
    return (
        f"lora-tune export {adapter_dir} --format gguf-lora --output adapter.gguf (each module's scale folded in), and a Modelfile "
        f"with FROM <the base as GGUF> and ADAPTER ./adapter.gguf - not ADAPTER {adapter_dir}: {'; '.join(unfit)}. Or the merged "
        f"model: lora-tune export {adapter_dir} --format ollama --output DIR"
    )


def check_config(cfg, targets, model_type: str) -> None:
    """Training-time check for `--serve-with ENGINE`: the options that would make the adapter
    unservable there are refused in one line, before loading, with what to do instead. `targets`
    is lora_tune.models.targets.Targets as resolved for the run (None: only the options are checked)."""
    engine = getattr(cfg, "serve_with", None)
    if not engine:
        return
    facts = AdapterFacts.from_train(cfg, targets, model_type)
    problems = problems_for(engine, facts)
    if problems:
        raise UserError(f"--serve-with {engine}: " + "; ".join(problems))
    if engine == "vllm" and vllm_max_lora_rank(facts.rank) > VLLM_DEFAULT_MAX_LORA_RANK:
        log.info("--serve-with vllm: rank %d needs vLLM started with --max-lora-rank %d", facts.rank, vllm_max_lora_rank(facts.rank))


def check_rollout(cfg, targets, model_type: str) -> None:
    """--rollout vllm hands the adapter to vLLM every generation batch: what vLLM would refuse to load
    (DoRA, expert tensors, the vision tower, ...) is refused before loading, as --serve-with vllm is."""
    if cfg.rollout != "vllm":
        return
    problems = vllm_problems(AdapterFacts.from_train(cfg, targets, model_type))
    if problems:
        raise UserError("--rollout vllm: vLLM can't use this run's adapter: " + "; ".join(problems))


@dataclass
class ServingReport:
    engine: str
    problems: list[str]
    command: str | None  # how to serve it, when it serves
    live: list | None = None  # --live: lora_tune.after.live_serving.Comparison per prompt

    @property
    def agrees(self) -> bool:
        """The live check found no prompt whose tokens differ early (True without --live)."""
        return live_serving.agrees(self.live) if self.live is not None else True


def run(cfg) -> ServingReport:
    """`lora-tune check-serving RUN_DIR --engine E`: reads adapter_config.json, the adapter's tensor
    names and the base's config.json (the family; an image-text model's parts), nothing heavy; a
    merged folder: `check_merged`. Refusals are one `error:` line (exit 2)."""
    folder = Path(cfg.source).expanduser()
    if cfg.live and cfg.engine != "vllm":
        raise UserError(f"--live serves the adapter on vLLM; it has no {cfg.engine} check: use --engine vllm, or leave --live out")
    if folder.is_dir() and not (folder / "adapter_config.json").is_file() and (folder / "config.json").is_file():
        if cfg.live:
            raise UserError(f"--live compares a served adapter with peft; {folder} is a merged model: give the run or adapter folder")
        return check_merged(cfg.engine, folder)
    folder = latest_adapter(folder)
    adapter_config, weights = read_adapter(folder)
    base = cfg.base or adapter_config.get("base_model_name_or_path") or ""
    base_config = config_of(base)
    facts = AdapterFacts.from_adapter_config(adapter_config, base_config.get("model_type", ""))
    # The weights say what the config may not: DoRA magnitudes, trained copies (modules_to_save), and
    # which modules they change (a target pattern can reach an image-text model's vision tower).
    facts.dora = facts.dora or any("lora_magnitude_vector" in k for k in weights)
    facts.vision_modules = vision.vision_modules(base_config, weights)
    problems = problems_for(cfg.engine, facts)
    if problems:
        raise UserError(f"check-serving {cfg.engine}: " + "; ".join(problems))
    command = how_to_serve(cfg.engine, facts, base, str(folder))
    # A target pattern (an image-text model's language model, anchored) is shown as the modules it reached.
    shown = facts.target_modules
    if isinstance(adapter_config.get("target_modules"), str):
        shown = sorted({m.rsplit(".", 1)[-1] for m in vision.adapted_modules(weights)})
    print(f"{cfg.engine}: this adapter serves (rank {facts.rank}, {', '.join(shown)})")
    print(f"serve it with: {command}")
    live = live_serving.check(cfg, folder, base, facts.rank) if cfg.live else None
    return ServingReport(cfg.engine, [], command, live)


def config_of(base: str) -> dict:
    """The base's config.json (aliases ship theirs); {} when unknown offline (a hub id: the family
    rules can't be applied, llama.cpp/ollama say so)."""
    if base in ALIASES:
        return architecture(base)
    path = Path(base).expanduser() / "config.json"
    return read_config(path, "--base") if path.is_file() else {}


def read_config(path: Path, option: str) -> dict:
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
        raise UserError(f"{option}: {path} is unreadable or not JSON ({first_line(e)}); restore it from the model's source") from None
    if not isinstance(config, dict):
        raise UserError(f"{option}: {path} holds a JSON {type(config).__name__}, not a model config")
    return config


# --- a merged folder ---------------------------------------------------------------------------------
def text_model_type(config: dict) -> str:
    """The language model's model_type: an image-text model's text config's, else the model's own."""
    if not vision.is_image_text(config):
        return config.get("model_type", "")
    obj = vision.config_object(config)
    return obj.get_text_config().model_type if obj is not None else (config.get("text_config") or {}).get("model_type", "")


def processor_problems(folder: Path) -> list[str]:
    """vLLM builds an image-text model's inputs with the folder's own processor (AutoProcessor): its
    files must be there and readable, beside the tokenizer's."""
    problems = []
    for name in vision.PROCESSOR_FILES:
        path = folder / name
        if path.exists() or path.is_symlink():
            try:
                if not isinstance(json.loads(path.read_bytes()), dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:
                problems.append(f"{path} is unreadable or not a processor's JSON ({first_line(e)}); copy it again from the base")
    if not any((folder / name).is_file() for name in vision.IMAGE_PROCESSOR_FILES):
        problems.append(
            f"vLLM builds an image-text model's image inputs with the folder's processor (AutoProcessor), and {folder} has no "
            f"{' or '.join(vision.IMAGE_PROCESSOR_FILES)}; merge again with `lora-tune merge` (it copies the base's processor files) "
            "or copy them from the base"
        )
    return problems


def check_merged(engine: str, folder: Path) -> ServingReport:
    """A merged model folder (config.json + safetensors, no adapter): what the engine reads besides the
    weights. vLLM: the tokenizer and, for an image-text model, the processor files. llama.cpp / Ollama:
    a family `lora-tune export` writes (an image-text model's language model; its vision projector,
    llama.cpp's mmproj, is never written by it)."""
    config = read_config(folder / "config.json", "check-serving")
    if shards.shard_files(folder) is None:
        raise UserError(f"check-serving: {folder} has no .safetensors weights; give a folder written by `lora-tune merge`")
    image_text = vision.is_image_text(config)
    problems = (
        [] if (folder / "tokenizer_config.json").is_file() else [f"{folder} has no tokenizer (tokenizer_config.json); copy the base's"]
    )
    text_type = text_model_type(config)
    if engine == "vllm" and image_text:
        problems += processor_problems(folder)
    elif engine != "vllm" and text_type not in LLAMA_CPP_FAMILIES:
        problems.append(
            f"{text_type or 'this'} language models have no GGUF export here (exported: {', '.join(LLAMA_CPP_FAMILIES)}); serve the merged "
            "folder with vLLM or transformers"
        )
    if problems:
        raise UserError(f"check-serving {engine}: " + "; ".join(problems))
    mmproj = " (image input also needs the vision projector, which export never writes: llama.cpp's mmproj file)" if image_text else ""
    command = {
        "vllm": f"vllm serve {folder}",
        "llama.cpp": f"lora-tune export {folder} --format gguf --output model.gguf, then llama-server -m model.gguf{mmproj}",
        "ollama": f"lora-tune export {folder} --format ollama --output ollama, then ollama create NAME -f ollama/Modelfile{mmproj}",
    }[engine]
    kind = "image-text, processor files present" if image_text and engine == "vllm" else config.get("model_type", "")
    print(f"{engine}: this merged model serves ({kind})")
    print(f"serve it with: {command}")
    return ServingReport(engine, [], command)
