"""Fixtures of the data tests."""

from __future__ import annotations

import pytest

from lora_tune.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model))
