"""Model aliases: short names that map to a hub id and carry the architecture (config.json) offline.

The architecture files live in `lora_tune/models/architectures/ALIAS.json`, so `plan` and validation know
the shapes of a 70B without touching the network; weights still come from the hub or a local path.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, scan_cache_dir

from lora_tune.errors import UserError, did_you_mean
from lora_tune.models.tiny.model import build_tiny_llama, tiny_llama_config


@dataclass(frozen=True)
class Alias:
    name: str
    hub_id: str  # where the weights come from; "local:tiny-llama" means built on this machine
    description: str


ALIASES = {
    a.name: a
    for a in [
        Alias("llama-70b", "meta-llama/Llama-3.1-70B", "Llama-3.1 70B"),
        Alias("llama-8b", "meta-llama/Llama-3.1-8B", "Llama-3.1 8B"),
        Alias("llama2-7b", "meta-llama/Llama-2-7b-hf", "Llama-2 7B"),
        Alias("llama2-13b", "meta-llama/Llama-2-13b-hf", "Llama-2 13B"),
        Alias("llama2-70b", "meta-llama/Llama-2-70b-hf", "Llama-2 70B"),
        Alias("mistral-7b", "mistralai/Mistral-7B-v0.1", "Mistral 7B v0.1"),
        Alias("qwen2.5-7b", "Qwen/Qwen2.5-7B", "Qwen2.5 7B"),
        Alias("qwen2.5-72b", "Qwen/Qwen2.5-72B", "Qwen2.5 72B"),
        Alias("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3 8B"),
        Alias("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", "Mixtral 8x7B (MoE: 8 experts, 2 active)"),
        Alias("gemma2-9b", "google/gemma-2-9b", "Gemma-2 9B"),
        Alias("phi3-mini", "microsoft/Phi-3-mini-4k-instruct", "Phi-3 mini 4k (fused qkv and gate_up)"),
        # Current releases. "Config rebuilt" means the shipped config.json was written from the model card's published
        # architecture (the hub was unreachable when it was added), not copied from the repository; its parameter
        # count matches the published one (tests/test_aliases.py).
        Alias("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "Qwen3 30B-A3B (MoE: 128 experts, 8 active)"),
        Alias(
            "qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", "Qwen3 235B-A22B (MoE: 128 experts, 8 active; config rebuilt from the model card)"
        ),
        Alias(
            "qwen3-next-80b-a3b",
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "Qwen3-Next 80B-A3B (gated delta net + attention, 512 experts + shared; config rebuilt from the model card)",
        ),
        Alias(
            "gemma3-27b", "google/gemma-3-27b-pt", "Gemma 3 27B (image-text checkpoint, SigLIP tower; config rebuilt from the model card)"
        ),
        Alias(
            "llama4-scout",
            "meta-llama/Llama-4-Scout-17B-16E",
            "Llama 4 Scout 17B-16E (image-text, MoE: 16 experts + shared; config rebuilt from the model card)",
        ),
        Alias("gpt-oss-20b", "openai/gpt-oss-20b", "gpt-oss 20B (MoE, MXFP4 experts: trained and merged dequantized)"),
        Alias(
            "gpt-oss-120b",
            "openai/gpt-oss-120b",
            "gpt-oss 120B (MoE, MXFP4 experts: trained and merged dequantized; config: gpt-oss-20b's with the published 36 layers, "
            "128 experts)",
        ),
        Alias(
            "glm4.5-air",
            "zai-org/GLM-4.5-Air",
            "GLM-4.5-Air (MoE: 128 experts + shared, dense first layer; config rebuilt from the model card)",
        ),
        Alias(
            "mistral-small3.2-24b",
            "mistralai/Mistral-Small-3.2-24B-Instruct-2506",
            "Mistral Small 3.2 24B (image-text checkpoint, Pixtral tower; config rebuilt from the model card)",
        ),
        Alias(
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3",
            "DeepSeek-V3 671B (MLA, 256 experts + shared, 3 dense layers, FP8 weights: trained dequantized; config rebuilt from the "
            "model card)",
        ),
        Alias("tiny-llama", "local:tiny-llama", "2-layer Llama with random weights, built offline (demo and tests)"),
    ]
}


def architecture(alias: str) -> dict:
    """The shipped config.json of an alias (the tiny one is computed, not shipped)."""
    if alias == "tiny-llama":
        return tiny_llama_config(512).to_dict()
    text = resources.files("lora_tune.models.architectures").joinpath(f"{alias}.json").read_text()
    return json.loads(text)


def tiny_llama_dir() -> Path:
    """Build the tiny demo model once per machine, in the user cache, and return its folder."""

    root = Path(os.environ.get("LORA_TUNE_CACHE", Path.home() / ".cache" / "lora_tune")) / "tiny-llama"
    if not (root / "model.safetensors").is_file():
        tmp = root.with_name(f"tiny-llama.tmp-{os.getpid()}")
        build_tiny_llama(tmp)
        try:
            tmp.rename(root)  # atomic: a folder named tiny-llama is always complete
        except OSError:
            shutil.rmtree(tmp)  # another process finished first
    return root


def looks_like_path(base: str) -> bool:
    return base.startswith((".", "/", "~")) or Path(base).exists() or base.count("/") > 1


def resolve_base(base: str) -> str:
    """Turn --base into something `from_pretrained` takes: a local folder or a hub id.

    Fails before any loading: unknown aliases get a suggestion, missing folders are named.
    """
    if base in ALIASES:
        hub_id = ALIASES[base].hub_id
        if hub_id == "local:tiny-llama":
            return str(tiny_llama_dir())
        check_hub_reachable(hub_id, "--base")
        return hub_id
    if looks_like_path(base):
        path = Path(base).expanduser()
        if not path.is_dir():
            raise UserError(
                f"--base: directory {base} does not exist; give a model folder, a hub id (org/name) or an alias from `lora-tune models`"
            )
        if not (path / "config.json").is_file():
            raise UserError(f"--base: {base} has no config.json; point it at a Hugging Face model folder")
        return str(path)
    if "/" not in base:
        raise UserError(
            f"--base: unknown model alias '{base}'{did_you_mean(base, ALIASES)}; run `lora-tune models` for the list, or give "
            "a hub id (org/name) or a local directory"
        )
    check_hub_reachable(base, "--base")
    return base


def check_hub_reachable(repo_id: str, option: str, repo_type: str = "model") -> None:
    """Fail in seconds, not after a minute of retries, when a hub id is neither in the local cache
    nor reachable (no network, or HF_HUB_OFFLINE)."""

    try:
        cached = any(r.repo_id == repo_id and r.repo_type == repo_type for r in scan_cache_dir(constants.HF_HUB_CACHE).repos)
    except Exception:  # noqa: BLE001 - no cache folder yet, or an unreadable one
        cached = False
    if cached:
        return
    kind = "dataset" if repo_type == "dataset" else "model"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1" and repo_type == "dataset":
        raise UserError(
            f"{option}: the {kind} {repo_id} is not in the local Hugging Face cache and offline mode is on (HF_HUB_OFFLINE); "
            "download it first, or give a local folder"
        )
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        raise UserError(
            f"{option}: the {kind} {repo_id} is not in the local Hugging Face cache and {host} can't be reached (no network?); "
            "download it where there is network, or give a local folder"
        ) from None
