"""The chunked linear + cross-entropy equals the full-logits loss, value and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import CohereConfig, LlamaConfig

from lora_tune.models.head import IGNORE, auto_chunk_size, chunking_refusal, linear_cross_entropy


def reference(hidden, weight, targets, divisor, softcap=None, bias=None):
    logits = (hidden @ weight.t() + (0 if bias is None else bias)).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum") / divisor


@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("softcap,with_bias", [(None, False), (30.0, False), (None, True)])
def test_chunked_loss_and_its_gradient_equal_the_full_logits(chunk, softcap, with_bias):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g, dtype=torch.float32)
    weight = torch.randn(97, 16, generator=g, dtype=torch.float32)
    bias = torch.randn(97, generator=g, dtype=torch.float32) if with_bias else None
    targets = torch.randint(0, 97, (50,), generator=g)
    targets[::4] = IGNORE
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    expected = reference(h1, weight, targets, 33.0, softcap, bias)
    got = linear_cross_entropy(h2, weight, targets, 33.0, chunk, softcap, bias)
    (2.5 * expected).backward()
    (2.5 * got).backward()  # an upstream gradient other than 1 is carried through
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-7)
    assert (h2.grad[::4] == 0).all()  # masked positions never reached the head


def test_no_gradient_is_kept_in_evaluation():
    hidden, weight = torch.randn(8, 4), torch.randn(11, 4)
    targets = torch.randint(0, 11, (8,))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, 8, 3)
    assert loss.grad_fn is None and loss == pytest.approx(float(reference(hidden, weight, targets, 8)), rel=1e-6)


def test_the_default_chunk_keeps_logits_about_as_big_as_the_hidden_states_and_at_least_128_tokens():
    assert auto_chunk_size(4096, 512, 32000) == 128  # ceil(32000 / 512) = 63 -> 4096 / 63 -> 65 -> 128
    assert auto_chunk_size(4096, 4096, 128256) == 128  # Llama-3-8B, one 4k row
    assert auto_chunk_size(16384, 8192, 128256) == 1024  # Llama-3-70B, 16k tokens
    # never below 128 tokens: fewer rows starve the head's matmul
    assert auto_chunk_size(3132, 512, 32000) == 128  # the CPU benchmark's micro-batch: Liger's rule says 64
    assert auto_chunk_size(10, 64, 512) == 128


def test_logit_scaling_models_fall_back_to_the_full_loss():
    assert chunking_refusal(LlamaConfig()) is None
    assert "logit_scale" in chunking_refusal(CohereConfig(logit_scale=0.0625))
