"""The shardable int8 layer: bitsandbytes' quantization, its dequantization in forward and backward,
and no reference to the int8 matrix outside the parameter (so ZeRO-3 and FSDP2 can split it)."""

from __future__ import annotations

import bitsandbytes as bnb
import torch

from lora_tune.models.int8_sharded import ShardableLinear8bit, dequantize


def quantized_layer(weight: torch.Tensor) -> ShardableLinear8bit:
    layer = ShardableLinear8bit(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False).to("cpu")
    layer.take_quantized()
    return layer


def test_forward_and_backward_compute_with_the_dequantized_weight():
    torch.manual_seed(0)
    weight = torch.randn(16, 32)
    layer = quantized_layer(weight)
    assert layer.weight.dtype == torch.int8 and layer.weight.CB is None and layer.state.CB is None  # nothing else holds the matrix
    w = dequantize(layer.weight, layer.row_scales, torch.float32)
    assert (w - weight).abs().max() <= weight.abs().max() / 127  # row-wise absmax int8: within one step
    x = torch.randn(4, 32, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ w.T)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 16) @ w)


def test_it_is_a_bitsandbytes_8bit_layer_for_peft():
    layer = quantized_layer(torch.randn(8, 8))
    assert isinstance(layer, bnb.nn.Linear8bitLt) and layer.state.SCB is layer.row_scales
