"""`lora-tune check-serving ADAPTER --engine vllm --live`: serve the adapter on a real vLLM, greedy-decode
a few prompts, and compare token by token with transformers + peft on the same base (both in fp32).
The static rules say whether vLLM takes the adapter; this says whether it computes it.

The server is the one at --vllm-url (serving the base with runtime LoRA), or one started for the
check with --vllm-python (or this interpreter, when vLLM imports here), its log in a temporary
folder removed after. Exit 1 when a prompt's tokens differ within the first FEW: at fp32 the two
compute the same model; a later divergence (a near tie that one of them breaks the other way, then
everything after it) is reported, not failed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_tune.errors import UserError
from lora_tune.models.loading import load_tokenizer
from lora_tune.training.generation import vllm_api, vllm_server

FEW = 8  # tokens that must agree at fp32
PROMPTS = (
    "The capital of France is",
    "Here is a short story about a robot:",
    "def add(a, b):",
    "List three colours:",
)


@dataclass
class Comparison:
    prompt: str
    served: list[int]
    reference: list[int]

    @property
    def divergence(self) -> int | None:
        """The first token where they differ (a shorter one ending counts), or None."""
        for k, (a, b) in enumerate(zip(self.served, self.reference)):
            if a != b:
                return k
        return None if len(self.served) == len(self.reference) else min(len(self.served), len(self.reference))


def prompts_of(path: str | None) -> list[str]:
    if path is None:
        return list(PROMPTS)
    try:
        lines = [line.strip() for line in Path(path).expanduser().read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"--prompts: {path} is unreadable ({getattr(e, 'strerror', None) or e}); give a text file, one prompt a line"
        ) from None
    if not lines:
        raise UserError(f"--prompts: {path} holds no prompt; give a text file, one prompt a line")
    return lines


def check(cfg, folder: Path, base: str, rank: int) -> list[Comparison]:
    """Serve `folder` (an adapter of `rank`) on vLLM over `base`; print the agreement; each prompt's
    tokens both ways."""
    prompts = prompts_of(cfg.prompts)
    tokenizer = load_tokenizer(str(folder) if (folder / "tokenizer_config.json").is_file() else base, False)
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    length = max(map(len, ids)) + cfg.max_new_tokens
    with tempfile.TemporaryDirectory(prefix="lora-tune-live-") as scratch:
        server = start_server(cfg, base, rank, length, Path(scratch))
        try:
            served = serve(server.client, cfg, folder, ids)
        finally:
            server.close()
    reference = peft_greedy(base, folder, ids, cfg.max_new_tokens, tokenizer)
    results = [Comparison(p, s, r) for p, s, r in zip(prompts, served, reference)]
    report(results, tokenizer)
    return results


def agrees(results: list[Comparison]) -> bool:
    return all(r.divergence is None or r.divergence >= FEW for r in results)


def start_server(cfg, base: str, rank: int, max_model_len: int, scratch: Path) -> vllm_api.Server:
    if cfg.vllm_url:
        vllm_server.check_server(_ServerOptions(cfg.vllm_url, rank), base, max_model_len)
        return vllm_api.Server(vllm_api.Client(cfg.vllm_url, 600), None, None, scratch / "adapters")
    python = cfg.vllm_python or (sys.executable if importlib.util.find_spec("vllm") else None)
    if python is None:
        raise UserError(
            "check-serving --live: vLLM is not installed here; pass --vllm-python PATH (the python of vLLM's environment) or "
            "--vllm-url of a running server"
        )
    url = f"http://127.0.0.1:{vllm_api.free_port()}"
    log_file = scratch / "vllm-server.log"
    args = vllm_api.server_args(base, url, "float32", rank, max_model_len)
    rpc = vllm_api.rpc_folder()
    process = vllm_api.launch(python, args, url, log_file, kv_cache_space=1, rpc=rpc)
    server = vllm_api.Server(vllm_api.Client(url, 600), process, log_file, scratch / "adapters", rpc)
    try:
        vllm_api.wait_healthy(server.client, url, 600, process, log_file)
    except UserError:
        server.close()
        raise
    return server


@dataclass
class _ServerOptions:
    """What check_server reads of a run's config: the URL, and for the printed command the rank
    (served in fp32, the comparison's precision)."""

    vllm_url: str
    rank: int
    precision: str = "fp32"


def serve(client: vllm_api.Client, cfg, folder: Path, ids: list[list[int]]) -> list[list[int]]:
    status, body = client.call("/v1/load_lora_adapter", {"lora_name": "check-serving", "lora_path": str(folder.resolve())}, 60)
    if status != 200:
        raise UserError(f"check-serving --live: vLLM refused the adapter ({vllm_api.error_text(body)})")
    try:
        out = []
        for prompt in ids:
            payload = {"model": "check-serving", "prompt": prompt, "max_tokens": cfg.max_new_tokens, "temperature": 0.0}
            status, body = client.call("/v1/completions", {**payload, "return_token_ids": True})
            if status != 200:
                raise UserError(f"check-serving --live: vLLM failed a completion ({vllm_api.error_text(body)})")
            out.append(list(json.loads(body)["choices"][0]["token_ids"]))
        return out
    finally:
        client.call("/v1/unload_lora_adapter", {"lora_name": "check-serving"}, 60)


@torch.no_grad()
def peft_greedy(base: str, folder: Path, ids: list[list[int]], max_new_tokens: int, tokenizer) -> list[list[int]]:
    """transformers + peft on the same base, fp32, greedy: what the adapter computes as trained."""
    from peft import PeftModel  # noqa: PLC0415 - start-up time: only the live check loads models
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - the same
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - the same

    from lora_tune.data.batching import pad_token_id  # noqa: PLC0415 - the same (it imports torch)
    from lora_tune.models.adapter import peft_building  # noqa: PLC0415 - the same (it imports peft)

    hf_logging.disable_progress_bar()  # the model loads in a blink here; its bar says nothing

    with peft_building():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(folder)).eval()
    eos = model.get_base_model().generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    pad = pad_token_id(tokenizer)
    out = []
    for prompt in ids:
        x = torch.tensor([prompt])
        generated = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad
        )
        new = generated[0, len(prompt) :].tolist()
        end = next((k for k, t in enumerate(new) if t in stops), None)
        out.append(new if end is None else new[: end + 1])
    return out


def report(results: list[Comparison], tokenizer) -> None:
    agree = sum(r.divergence is None for r in results)
    matched = sum(len(r.served) if r.divergence is None else r.divergence for r in results)
    total = sum(max(len(r.served), len(r.reference)) for r in results)
    print(f"vllm live: {agree}/{len(results)} prompts token for token equal to transformers + peft; {matched}/{total} tokens agree")
    for r in results:
        k = r.divergence
        if k is None:
            continue
        ours = tokenizer.decode(r.served[k : k + 1]) if k < len(r.served) else "(end)"
        theirs = tokenizer.decode(r.reference[k : k + 1]) if k < len(r.reference) else "(end)"
        print(f"  {r.prompt[:40]!r}: first divergence at token {k}: vLLM {ours!r} vs transformers + peft {theirs!r}")
    if not agrees(results):
        print(
            f"error: vLLM serves this adapter differently from transformers + peft within the first {FEW} tokens at fp32", file=sys.stderr
        )
