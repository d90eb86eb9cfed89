"""sdpa_packed: SDPA once per packed sample gives transformers' sdpa numbers in every family that
calls attention through its interface, and falls back to sdpa itself wherever the row's mask is not
the plain block-diagonal causal one (a sliding window, unpacked rows, a KV cache)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import profile
from transformers import AutoModelForCausalLM, LlamaConfig, MambaConfig

from lora_tune.errors import UserError
from lora_tune.models import attention
from lora_tune.models.loading import attention_implementation

from families import family_configs

# Two packed rows: samples of 5, 7 and 10 tokens then a 2-token tail; of 12, 6, 3 and 3.
POSITIONS = torch.tensor([[*range(5), *range(7), *range(10), *range(2)], [*range(12), *range(6), *range(3), *range(3)]])
IDS = torch.randint(3, 500, POSITIONS.shape, generator=torch.Generator().manual_seed(0))
PER_SAMPLE = 8  # SDPA calls per layer's forward over these rows: one per sample
# Mistral's config carries a sliding window (transformers passes it to attention): sdpa itself runs.
FALLS_BACK = {"mistral"}


def loss_grads_and_sdpa_calls(model, implementation: str, position_ids):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    with profile() as prof:
        loss = model(input_ids=IDS, position_ids=position_ids, labels=IDS, use_cache=False).loss
        loss.backward()
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), calls


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "phi3", "gpt_neox", "gpt2"])
def test_per_sample_attention_gives_sdpa_numbers_over_packed_rows(family):
    config = family_configs(512)[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()  # eval: no dropout to compare
    loss, grads, calls = loss_grads_and_sdpa_calls(model, "sdpa", POSITIONS)
    packed_loss, packed_grads, packed_calls = loss_grads_and_sdpa_calls(model, attention.NAME, POSITIONS)
    assert packed_loss == pytest.approx(loss, rel=1e-6)
    assert (packed_grads - grads).abs().max() <= 1e-5 * grads.abs().max()
    layers = config.get_text_config().num_hidden_layers
    assert calls == layers  # sdpa: one masked call per layer
    assert packed_calls == (layers if family in FALLS_BACK else layers * PER_SAMPLE)


def test_unpacked_rows_and_generation_run_sdpa_itself():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_configs(512)["llama"], attn_implementation="sdpa").float().eval()
    unpacked = torch.arange(IDS.shape[1]).expand_as(IDS)
    loss, grads, _ = loss_grads_and_sdpa_calls(model, "sdpa", unpacked)
    packed_loss, packed_grads, calls = loss_grads_and_sdpa_calls(model, attention.NAME, unpacked)
    assert (packed_loss, calls) == (loss, 2) and torch.equal(packed_grads, grads)
    prompt = IDS[:, :6]
    texts = {}
    for implementation in ("sdpa", attention.NAME):
        model.set_attn_implementation(implementation)
        texts[implementation] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
    assert torch.equal(texts["sdpa"], texts[attention.NAME])


def cfg(choice="auto", packing=True, compile=False, sequence_parallel=1):
    return SimpleNamespace(attn_implementation=choice, packing=packing, compile=compile, sequence_parallel=sequence_parallel)


def test_auto_picks_per_sample_attention_on_a_cpu_for_packed_eager_layers():
    llama, cpu = LlamaConfig(), torch.device("cpu")
    assert attention_implementation(cfg(), llama, cpu) == attention.NAME
    assert attention_implementation(cfg(packing=False), llama, cpu) == "sdpa"
    assert attention_implementation(cfg(compile=True), llama, cpu) == "sdpa"  # Python per sample would break the graph
    assert attention_implementation(cfg("sdpa"), llama, cpu) == "sdpa"
    assert attention_implementation(cfg(), MambaConfig(), cpu) == "eager"  # no attention interface: as before
    # --sequence-parallel: the same attention, across the group's slices of every row
    assert attention_implementation(cfg(sequence_parallel=2), llama, cpu) == "ulysses_sdpa_packed"
    assert attention_implementation(cfg("eager", sequence_parallel=2), llama, cpu) == "ulysses_eager"
    with pytest.raises(UserError, match="sdpa_packed runs Python per sample, which --compile can't capture; use sdpa"):
        attention_implementation(cfg(attention.NAME, compile=True), llama, cpu)
    with pytest.raises(UserError, match="mamba does not call attention through transformers' interface; use sdpa"):
        attention_implementation(cfg(attention.NAME), MambaConfig(), cpu)


def test_attention_quadratic_in_the_row_is_said_in_one_line():
    assert attention.quadratic_attention_warning("sdpa_packed", 16384, True) is None
    line = attention.quadratic_attention_warning("sdpa_packed", 65536, True)
    assert "[tokens x tokens] mask" in line and "(12 GiB while it is built, per row)" in line and "--sequence-parallel" in line
    assert attention.quadratic_attention_warning("sdpa", 65536, False) is None  # unpacked rows: SDPA's causal kernel, no mask
    eager = attention.quadratic_attention_warning("eager", 8192, False)
    assert "eager attention keeps every layer's [heads x 8,192 x 8,192] scores" in eager
    assert attention.quadratic_attention_warning("ulysses_sdpa_packed", 1 << 20, True) is None  # sequence parallel: no mask
    assert attention.quadratic_attention_warning("flash_attention_2", 1 << 20, True) is None
