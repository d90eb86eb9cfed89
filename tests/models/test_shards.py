"""Reading a model folder's safetensors shards without loading them: the files, every tensor's byte
range, and a truncated, empty or foreign file named before anything reads it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from lora_tune.errors import UserError
from lora_tune.models import shards


@pytest.fixture
def shard(tmp_path):
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "c": torch.tensor([1, 2], dtype=torch.int64),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_each_entry_is_the_tensors_exact_bytes(shard):
    path, tensors = shard
    entries = shards.read_header(path)
    raw = path.read_bytes()
    for name, tensor in tensors.items():
        e = entries[name]
        assert (e.dtype, e.shape) == (shards.NAMES[tensor.dtype], tuple(tensor.shape))
        data = raw[e.offset : e.offset + e.nbytes]
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=tensor.dtype).reshape(tensor.shape), tensor)


def test_a_truncated_shard_is_named_with_where_it_ends(shard):
    path, _ = shard
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(UserError, match=r"model.safetensors is truncated \(\d+ bytes, but \w ends at byte"):
        shards.read_header(path)


@pytest.mark.parametrize("content", [b"", b"garbage that is not safetensors", (10**12).to_bytes(8, "little") + b"{}"])
def test_an_empty_or_foreign_file_is_refused(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(UserError, match="is not a readable safetensors file"):
        shards.read_header(path)


def test_the_index_names_the_shards_and_a_missing_one_is_refused(tmp_path, shard):
    path, _ = shard
    path.rename(tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / shards.INDEX).write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}})
    )
    assert [p.name for p in shards.shard_files(tmp_path)] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors is listed in model.safetensors.index.json but missing"):
        shards.read_headers(tmp_path)


def test_a_folder_without_weights_has_no_shards(tmp_path):
    assert shards.shard_files(tmp_path) is None
    with pytest.raises(UserError, match="has neither model.safetensors nor model.safetensors.index.json"):
        shards.read_headers(tmp_path)
    (tmp_path / shards.INDEX).write_text("not json")
    with pytest.raises(UserError, match="is unreadable or not a safetensors index"):
        shards.shard_files(tmp_path)


def test_a_hub_base_is_fingerprinted_from_its_local_snapshot(tiny_model, tmp_path, monkeypatch):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_model, snapshot)
    monkeypatch.setattr(shards, "try_to_load_from_cache", lambda repo, name: str(snapshot / name) if repo == "org/tiny" else None)
    assert shards.base_fingerprint("org/tiny", False) == shards.base_fingerprint(str(tiny_model), False)
    assert shards.base_fingerprint("org/elsewhere", False) is None  # not in the cache: from_pretrained downloads it
    (snapshot / "model.safetensors").unlink()  # not all downloaded yet
    assert shards.base_fingerprint("org/tiny", False) is None
