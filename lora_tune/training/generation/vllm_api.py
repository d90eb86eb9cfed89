"""vLLM as lora-tune uses it: what its OpenAI server takes (LoRA ranks, dtypes, the CPU kernels' head
sizes, sampling parameters) and how a server is started, reached and stopped. Shared by the GRPO
rollouts (`vllm_server`, `vllm_colocate`) and `check-serving --live`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from lora_tune.engines import ranks as dist
from lora_tune.errors import UserError
from lora_tune.training.generation import handover

log = logging.getLogger("lora_tune")

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


def reason(error: BaseException) -> str:
    inner = getattr(error, "reason", None)
    return str(inner or error) or type(error).__name__


# --- a server lora-tune starts ---------------------------------------------------------------------------
class Server:
    """What `start` leaves running for the run: the server's client, and the server process when
    lora-tune started it (rank 0), stopped by `close`."""

    def __init__(self, client: Client, process: subprocess.Popen | None, log_file: Path | None, adapters: Path, rpc: Path | None = None):
        self.client, self.process, self.log_file, self.adapters, self.rpc = client, process, log_file, adapters, rpc

    def close(self) -> None:
        if dist.is_main():
            handover.remove(self.adapters)  # the run's adapters for vLLM: none outlives it
        if self.process is not None:
            self._stop()
        remove_rpc_folder(self.rpc)

    def _stop(self) -> None:
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


RPC_ENV = "VLLM_RPC_BASE_PATH"


def rpc_folder() -> Path | None:
    """A folder for the IPC sockets of a vLLM engine lora-tune starts: vLLM makes one per engine in
    the temporary folder and never removes them, so each engine gets a folder removed when it stops
    (a short path: a socket's path has at most 107 characters). None when the user chose one
    ($VLLM_RPC_BASE_PATH)."""
    return None if os.environ.get(RPC_ENV) else Path(tempfile.mkdtemp(prefix="lora-tune-vllm-"))


def remove_rpc_folder(folder: Path | None) -> None:
    if folder is not None and not folder.is_symlink():
        shutil.rmtree(folder, ignore_errors=True)


def launch(python: str, args: list[str], url: str, log_file: Path, kv_cache_space: float, rpc: Path | None = None) -> subprocess.Popen:
    """vLLM's OpenAI server as a child of this process (its own session, so its engine's processes
    stop with it), logging to `log_file`, its IPC sockets in `rpc` (rpc_folder)."""
    host, port = address(url)
    if Client(url, 5).healthy() or port_taken(host, port):
        raise UserError(f"--vllm-python: something already listens at {url}; stop it, or give --vllm-url another port")
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_space:g}"}
    if rpc is not None:
        env[RPC_ENV] = str(rpc)
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


# --- generation ------------------------------------------------------------------------------------------
def sampling(cfg, eos_ids: set[int]) -> dict:
    """vLLM's sampling parameters of a completion (the same names in a request and in SamplingParams):
    the run's temperature, top-p, top-k (0: off), length and stop tokens, and the sampled token's
    log-probability (`logprobs` 0)."""
    return {
        "max_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k or -1,
        "logprobs": 0,
        "stop_token_ids": sorted(eos_ids),
    }


def vllm_seed(seed: int) -> int:
    """A completion's seed in the range vLLM takes."""
    return seed % (2**31 - 1)
