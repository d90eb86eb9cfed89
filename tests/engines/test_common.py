"""What every engine shares: optimizers, the pickle-free per-rank checkpoint state, and the count
of what a rank holds of the base."""

from __future__ import annotations

from types import SimpleNamespace

import bitsandbytes as bnb
import pytest
import torch

from lora_tune.engines import common
from lora_tune.models.loading import load_base_model

from helpers import ALPACA, LORAPLUS_RATIO, LORAPLUS_RUN, adapter_tensors, assert_loraplus_first_step, fast_train_args, run_cli, write_jsonl


def cfg(**kw):
    return SimpleNamespace(**{"warmup_steps": 1, "warmup_ratio": 0.0, "lr_scheduler": "cosine", **kw})


@pytest.mark.parametrize(
    "name,kind", [("adamw", torch.optim.AdamW), ("adamw_8bit", bnb.optim.AdamW8bit), ("paged_adamw_8bit", bnb.optim.PagedAdamW8bit)]
)
def test_build_optimizer_by_name(name, kind):
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = common.build_optimizer(name, [param], lr=1e-3, weight_decay=0.1)
    assert isinstance(optimizer, kind) and optimizer.param_groups[0]["lr"] == 1e-3 and optimizer.param_groups[0]["weight_decay"] == 0.1


def test_warmup_steps_win_over_the_ratio():
    assert common.warmup_steps(cfg(warmup_steps=3, warmup_ratio=0.5), 100) == 3
    assert common.warmup_steps(cfg(warmup_steps=0, warmup_ratio=0.05), 100) == 5


def train_steps(params, optimizer, scheduler, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit"])
def test_rank_state_round_trips_without_pickle_and_continues_bit_for_bit(name, tmp_path):
    """Save after 3 steps, reload into fresh objects, take 3 more: the same weights as 6 in a row."""

    def fresh():
        torch.manual_seed(0)
        # Two 8-bit-sized tensors (bitsandbytes gives them one shared quantization map) and a small one.
        params = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80, 64)), torch.nn.Parameter(torch.randn(7))]
        optimizer = common.build_optimizer(name, params, 1e-2, 0.01)
        return params, optimizer, common.build_scheduler(cfg(), optimizer, 6)

    params, optimizer, scheduler = fresh()
    train_steps(params, optimizer, scheduler, 6, seed=1)
    straight = [p.detach().clone() for p in params]

    params, optimizer, scheduler = fresh()
    g = torch.Generator().manual_seed(1)  # the same gradients: first 3 steps here, last 3 after the reload
    train_steps(params, optimizer, scheduler, 3, seed=1)
    torch.manual_seed(1234)
    common.save_rank_state(tmp_path, optimizer, scheduler, scaler={"scale": 65536.0, "_growth_tracker": 3})
    expected_rng = torch.rand(3)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".safetensors", ".safetensors"]  # no pickle at all
    saved = [p.detach().clone() for p in params]

    params, optimizer, scheduler = fresh()
    with torch.no_grad():
        for p, value in zip(params, saved):
            p.copy_(value)
    state = common.load_rank_state(tmp_path)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    assert state["scaler"] == {"scale": 65536.0, "_growth_tracker": 3}
    assert torch.equal(torch.rand(3), expected_rng), "the RNG continues where it was saved"
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # skip the gradients of the first 3 steps
        for p in params:
            torch.randn(p.shape, generator=g)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
        scheduler.step()
    for p, want in zip(params, straight):
        assert torch.equal(p.detach(), want)


def test_base_tensor_bytes_counts_a_4bit_base_with_its_quant_states(tiny_model):
    model = load_base_model(str(tiny_model), "4bit", torch.device("cpu"))
    held, whole = common.base_tensor_bytes(model)
    expected = 0
    for p in model.parameters():
        expected += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if state is not None:
            expected += sum(t.numel() * t.element_size() for t in state.as_dict().values() if torch.is_tensor(t))
    expected += sum(b.numel() * b.element_size() for b in model.buffers())
    assert held == whole
    # Each quant state's code book is one tensor shared by every layer: counted once, so at most the sum.
    assert 0.9 * expected <= held <= expected


def test_memory_line_says_what_a_rank_holds():
    model = torch.nn.Linear(4, 4)
    model.weight.requires_grad_(False)
    line = common.memory_line(model, torch.device("cpu"), "cpu", "zero-3", (8, 16))
    assert line.startswith("zero-3: rank 0 holds 8 of 16 base parameters (") and line.endswith("on host (CPU offload)")
    assert "holds the whole base (" in common.memory_line(model, torch.device("cpu"), "none", "zero-2", None)


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "paged_adamw_8bit"])
def test_loraplus_groups_b_and_one_dimensional_tensors_at_the_ratio(name):
    """peft's create_loraplus_optimizer grouping: lora_B and 1-d tensors (DoRA magnitudes) at R x lr."""
    a, b, m = (torch.nn.Parameter(torch.zeros(s)) for s in ((4, 8), (8, 4), (8,)))
    named = [("x.lora_A.default.weight", a), ("x.lora_B.default.weight", b), ("x.lora_magnitude_vector.default.weight", m)]
    optimizer = common.build_optimizer(name, common.param_groups(named, 1e-3, 16.0), 1e-3, 0.1)
    groups = [(g["lr"], g["lr_ratio"], [id(p) for p in g["params"]]) for g in optimizer.param_groups]
    assert groups == [(1e-3, 1.0, [id(a)]), (pytest.approx(16e-3), 16.0, [id(b), id(m)])]
    assert common.param_groups(named, 1e-3, None) == [a, b, m]  # without LoRA+: the tensors, one group


def test_a_resumed_schedule_keeps_each_groups_lr_ratio(tmp_path):
    """Resumed (here with --lr changed): every group restarts at its own multiple of the new --lr."""
    named = [(f"l.lora_{ab}.default.weight", torch.nn.Parameter(torch.zeros(2, 2))) for ab in "AB"]
    optimizer = common.build_optimizer("adamw", common.param_groups(named, 1e-2, 8.0), 1e-2, 0.0)
    scheduler = common.build_scheduler(cfg(warmup_steps=0), optimizer, 4)
    train_steps([p for _, p in named], optimizer, scheduler, 2, seed=0)
    common.save_rank_state(tmp_path, optimizer, scheduler)
    optimizer = common.build_optimizer("adamw", common.param_groups(named, 1e-2, 8.0), 1e-2, 0.0)
    scheduler = common.build_scheduler(cfg(warmup_steps=0), optimizer, 4)
    state = common.load_rank_state(tmp_path)
    optimizer.load_state_dict(state["optimizer"])
    resumed = common.resumed_scheduler(cfg(warmup_steps=0, lr=2e-2, weight_decay=0.0), scheduler, state["scheduler"])
    a, b = resumed.get_last_lr()
    assert a == pytest.approx(2e-2 * 0.5) and b == pytest.approx(8 * a)  # cosine over 4 steps, at step 2: half the peak


def test_loraplus_moves_every_b_element_by_ratio_times_lr_in_one_adamw_step(tiny_model, tmp_path, capsys):
    """One AdamW step from B = 0: A's gradient is zero (B is), so A stays; each B element moves by its
    group's lr x g / (|g| + eps), which is lr where the gradient dwarfs eps: R times plain LoRA's
    step under LoRA+, element for element."""
    data = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    runs = {}
    for name, ratio in (("plain", None), ("plus", LORAPLUS_RATIO)):
        plus = {"loraplus_lr_ratio": ratio} if ratio else {}
        code, _, err = run_cli(fast_train_args(tiny_model, data, tmp_path / name, **LORAPLUS_RUN, grad_accum=2, **plus), capsys)
        assert code == 0, err
        runs[name] = adapter_tensors(tmp_path / name)
    assert_loraplus_first_step(runs["plus"], runs["plain"])
