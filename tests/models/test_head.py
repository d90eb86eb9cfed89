"""The chunked linear + cross-entropy equals the full-logits loss, value and gradients; so do the
chunked per-sequence and per-token log-probabilities (and the per-token entropy)."""

from __future__ import annotations

import pytest
import torch
from transformers import CohereConfig, LlamaConfig

from lora_tune.models.head import IGNORE, auto_chunk_size, chunking_refusal, linear_cross_entropy, sequence_log_probs, token_log_probs


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


def full_log_softmax(hidden, weight, softcap=None, bias=None, temperature=1.0):
    """The full [positions x vocab] log-softmax, in float64: the exact value both fp32 routes (the full
    logits and the chunks) are within rounding of (they differ from each other by as much as each
    differs from it, about 1e-6 of the largest gradient here)."""
    logits = hidden.double() @ weight.double().t() + (0 if bias is None else bias.double())
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.log_softmax(logits / temperature, dim=-1)


def close(got, expected, tolerance=1e-6) -> bool:
    """Within `tolerance` of the largest expected magnitude (at least 1)."""
    return float((got.double() - expected.double()).abs().max()) <= tolerance * max(1.0, float(expected.abs().max()))


def head_case(with_bias, positions=50, width=16, vocab=97):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, width, generator=g, dtype=torch.float32)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float32)
    bias = torch.randn(vocab, generator=g, dtype=torch.float32) if with_bias else None
    targets = torch.randint(0, vocab, (positions,), generator=g)
    targets[::4] = IGNORE
    targets[5:9] = IGNORE
    return hidden, weight, bias, targets


@pytest.mark.parametrize("chunk", [1, 3, 4096])
@pytest.mark.parametrize("softcap,with_bias,temperature", [(None, False, 1.0), (30.0, False, 0.7), (None, True, 1.3), (5.0, True, 0.9)])
def test_token_log_probs_and_entropy_equal_the_full_log_softmax(chunk, softcap, with_bias, temperature):
    hidden, weight, bias, targets = head_case(with_bias)
    keep = targets != IGNORE
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    full = full_log_softmax(h1, weight, softcap, bias, temperature)[keep]
    expected = full.gather(1, targets[keep].unsqueeze(1)).squeeze(1)
    expected_entropy = -(full.exp() * full).sum(-1)
    got, entropy = token_log_probs(h2, weight, targets, chunk, softcap, bias, temperature)
    assert got.shape == (int(keep.sum()),) and got.dtype == entropy.dtype == torch.float32
    assert not entropy.requires_grad
    upstream = torch.linspace(-2.0, 3.0, got.numel())  # a different upstream gradient per token
    (upstream.double() * expected).sum().backward()
    (upstream * got).sum().backward()
    assert close(got.detach(), expected.detach()) and close(entropy, expected_entropy.detach())
    assert close(h2.grad, h1.grad)
    assert (h2.grad[~keep] == 0).all()  # masked positions never reached the head


@pytest.mark.parametrize("chunk", [1, 3, 4096])
@pytest.mark.parametrize("softcap,with_bias", [(None, False), (30.0, True)])
def test_sequence_log_probs_equal_the_full_log_softmax(chunk, softcap, with_bias):
    hidden, weight, bias, targets = head_case(with_bias)
    owners = torch.arange(50) // 13  # four sequences
    keep = targets != IGNORE
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    per_token = full_log_softmax(h1, weight, softcap, bias)[keep].gather(1, targets[keep].unsqueeze(1)).squeeze(1)
    expected = torch.zeros(4, dtype=torch.float64).index_add(0, owners[keep], per_token)
    got = sequence_log_probs(h2, weight, targets, owners, 4, chunk, softcap, bias)
    upstream = torch.tensor([0.5, -1.0, 2.0, 1.5])
    (upstream.double() * expected).sum().backward()
    (upstream * got).sum().backward()
    assert close(got.detach(), expected.detach()) and close(h2.grad, h1.grad)


def test_token_log_probs_keep_nothing_without_a_gradient():
    hidden, weight, _, targets = head_case(False)
    with torch.no_grad():
        got, entropy = token_log_probs(hidden, weight, targets, 3)
    assert got.grad_fn is None
    full = full_log_softmax(hidden, weight)[targets != IGNORE]
    assert close(got, full.gather(1, targets[targets != IGNORE].unsqueeze(1)).squeeze(1)) and close(entropy, -(full.exp() * full).sum(-1))


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
    assert auto_chunk_size(262144, 4096, 128256) == 2048  # Llama-3-8B, one 262k row: the rule's 8,192 capped


def test_logit_scaling_models_fall_back_to_the_full_loss():
    assert chunking_refusal(LlamaConfig()) is None
    assert "logit_scale" in chunking_refusal(CohereConfig(logit_scale=0.0625))
