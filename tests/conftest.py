"""Shared fixtures: a tiny Llama saved to disk (loaded through the real from_pretrained path) and
small datasets in each format. Helpers that are not fixtures live in helpers.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Before the libraries load (datasets reads its cache folder at import): offline, and the suite's
# tokenized data cached apart from the user's.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="lora-tune-tests-datasets-"))

import datasets.utils.logging  # noqa: E402
import pytest  # noqa: E402

from lora_tune.models.adapter import peft_building  # noqa: E402
from lora_tune.models.tiny.agent import build_tiny_agent  # noqa: E402
from lora_tune.models.tiny.model import build_tiny_llama  # noqa: E402
from lora_tune.training.generation import vllm_api as vllm  # noqa: E402

from helpers import ALPACA, CHAT, PROMPT_COMPLETION, ROOT, TEXT, free_port, write_jsonl  # noqa: E402


def pytest_configure(config):
    # datasets gives its logger a handler bound to whatever sys.stderr is the first time it logs;
    # if that happens inside a test's capsys, later tests log into a closed stream ("--- Logging
    # error ---" in their stderr). Bind it now, to the session's stream.
    datasets.utils.logging.get_logger("datasets")


@pytest.fixture(autouse=True)
def compiler_variables_kept():
    """A test that builds a BOFT adapter with peft itself (PeftModel.from_pretrained in the test's own
    code) gets $CC/$CXX set to gcc by peft and never put back; the later tests' C++ builds (Inductor's
    kernels, in this process and the ones it starts) would then fail. lora-tune's own calls keep them
    (tests/models/test_adapter_types.py checks inside the test, before this puts them back)."""
    with peft_building():
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_no_template(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-nochat"), with_chat_template=False)


@pytest.fixture(scope="session")
def tiny_agent(tmp_path_factory) -> Path:
    """The tiny Llama with Qwen2.5's tool template, fine-tuned on examples/data/arithmetic_demos.jsonl
    until its rollouts call the calculator (lora_tune.models.tiny.agent)."""
    return build_tiny_agent(tmp_path_factory.mktemp("tiny-agent"), ROOT / "examples" / "data" / "arithmetic_demos.jsonl", steps=120)


@pytest.fixture
def data_files(tmp_path) -> dict[str, Path]:
    return {
        "alpaca": write_jsonl(tmp_path / "alpaca.jsonl", ALPACA),
        "messages": write_jsonl(tmp_path / "chat.jsonl", CHAT),
        "prompt_completion": write_jsonl(tmp_path / "pc.jsonl", PROMPT_COMPLETION),
        "text": write_jsonl(tmp_path / "text.jsonl", TEXT),
    }


# --- vLLM (--rollout vllm, check-serving --live) -------------------------------------------------------
# vLLM lives in an environment of its own (it pins its own transformers): `.ci/vllm-env` builds it and
# .ci/run passes its python here. Without it the vLLM tests skip.
VLLM_PYTHON = os.environ.get("LORA_TUNE_VLLM_PYTHON")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    if not VLLM_PYTHON:
        pytest.skip("no vLLM environment (.ci/vllm-env builds one; LORA_TUNE_VLLM_PYTHON names its python)")
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_tiny_model(tmp_path_factory) -> Path:
    """The tiny Llama with heads of 32 (vLLM's CPU attention takes no smaller), its weights 15x the
    usual scale so that a LoRA moves its sampling far in a few steps (see test_rollout's peaky model)."""
    shape = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024)
    return build_tiny_llama(tmp_path_factory.mktemp("vllm-tiny-llama"), initializer_range=0.3, **shape)


@pytest.fixture(scope="session")
def vllm_server(vllm_python, vllm_tiny_model, tmp_path_factory):
    """One vLLM OpenAI server for the session, on the tiny model, as the README's command starts it
    (fp32, runtime LoRA, rank up to 16, TRL's processed log-probabilities): its URL."""
    url = f"http://127.0.0.1:{free_port()}"
    log_file = tmp_path_factory.mktemp("vllm-server") / "server.log"
    args = vllm.server_args(str(vllm_tiny_model), url, "float32", 16, 1024)
    rpc = vllm.rpc_folder()
    process = vllm.launch(vllm_python, args, url, log_file, kv_cache_space=1, rpc=rpc)
    server = vllm.Server(vllm.Client(url, 60), process, log_file, log_file.parent / "adapters", rpc)
    try:
        vllm.wait_healthy(server.client, url, 300, process, log_file)
        yield url
    finally:
        server.close()
