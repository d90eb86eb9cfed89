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

from lora_tune.models.tiny.model import build_tiny_llama  # noqa: E402

from helpers import ALPACA, CHAT, PROMPT_COMPLETION, TEXT, write_jsonl  # noqa: E402


def pytest_configure(config):
    # datasets gives its logger a handler bound to whatever sys.stderr is the first time it logs;
    # if that happens inside a test's capsys, later tests log into a closed stream ("--- Logging
    # error ---" in their stderr). Bind it now, to the session's stream.
    datasets.utils.logging.get_logger("datasets")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_no_template(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-nochat"), with_chat_template=False)


@pytest.fixture
def data_files(tmp_path) -> dict[str, Path]:
    return {
        "alpaca": write_jsonl(tmp_path / "alpaca.jsonl", ALPACA),
        "messages": write_jsonl(tmp_path / "chat.jsonl", CHAT),
        "prompt_completion": write_jsonl(tmp_path / "pc.jsonl", PROMPT_COMPLETION),
        "text": write_jsonl(tmp_path / "text.jsonl", TEXT),
    }
