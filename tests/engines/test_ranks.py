"""The rank helpers on one process, and with a process group (one rank): agreement and sums."""

from __future__ import annotations

import pytest
import torch

from lora_tune.engines import ranks as dist


def test_without_a_process_group_everything_is_this_process():
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (0, 1, True)
    assert dist.any_rank(True) is True and dist.any_rank(False) is False
    assert dist.all_sum(2.5) == 2.5
    rows = torch.arange(6.0).reshape(3, 2)
    assert dist.all_gather_rows(rows) is rows
    assert dist.first_message("a reward failed") == "a reward failed" and dist.first_message(None) is None
    dist.barrier()  # nothing to wait for


@pytest.fixture
def one_rank_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_collectives_in_a_group(one_rank_group):
    assert dist.any_rank(True) is True and dist.any_rank(False) is False
    assert dist.all_sum(3.0) == 3.0
    rows = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(dist.all_gather_rows(rows), rows)  # rank order, on 2 ranks: tests/engines/test_sharded_runs.py (GRPO)
    assert dist.first_message("stop") == "stop" and dist.first_message(None) is None


def test_launched_means_a_launcher_set_the_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not dist.launched()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert dist.launched()
