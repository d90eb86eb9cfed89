"""An LLM.int8 linear layer that ZeRO-3 can really partition.

bitsandbytes' `Linear8bitLt` keeps the whole int8 matrix referenced outside its parameter
(`weight.CB`, then `state.CB`, and its forward writes `weight.data = state.CB` back), so however
DeepSpeed partitions the parameter, every rank still holds the whole base (bitsandbytes #1249).
`ShardableLinear8bit` computes from the int8 parameter that ZeRO has gathered for this
forward/backward and from its per-row scales (a small buffer, whole on every rank), and keeps no
other reference to the matrix: an autograd function saves the parameter itself (not a copy) and
dequantizes it again in backward, after ZeRO has re-gathered it, the way DeepSpeed's own ZeRO-3
linear treats weights.

The quantization is bitsandbytes' (`Int8Params`: row-wise absmax to int8) and so is the dequant
formula (`CB * SCB / 127` in the activation dtype, bitsandbytes' `MatMul8bitFp`). The matmul runs
in the compute dtype: weight-only int8, without LLM.int8's outlier decomposition, which on CUDA
one-device runs still use; on CPU bitsandbytes computes exactly this, so the two routes agree there.

It subclasses `Linear8bitLt`, so peft wraps it with its 8-bit LoRA layer as it does any 8-bit base.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch


class _DequantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, row_scales, bias):
        ctx.save_for_backward(weight, row_scales)  # the parameter itself: ZeRO re-gathers it for backward
        return torch.nn.functional.linear(x, dequantize(weight, row_scales, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_output):
        weight, row_scales = ctx.saved_tensors
        w = dequantize(weight, row_scales, grad_output.dtype)
        return grad_output @ w, None, None, None  # the base is frozen: only the input needs a gradient


def dequantize(weight: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' row-wise int8 dequantization, in `dtype`."""
    return weight.data.to(dtype).mul_(row_scales.unsqueeze(1).mul(1.0 / 127.0))


class ShardableLinear8bit(bnb.nn.Linear8bitLt):
    """Linear8bitLt whose int8 matrix lives only in its (partitionable) parameter."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None):
        super().__init__(in_features, out_features, bias=bias, has_fp16_weights=False, threshold=0.0, device=device)
        self.register_buffer("row_scales", torch.empty(out_features, dtype=torch.float32, device=device))

    def take_quantized(self) -> None:
        """After `Int8Params` quantized the weight: move its row scales into our buffer and drop every
        other reference to the int8 matrix (weight.CB is the parameter's own data)."""
        self.row_scales = self.weight.SCB.float()
        self.weight.CB = None
        self.weight.SCB = None
        self.state.CB = None
        # peft's DoRA reads the scales from here to dequantize (inside ZeRO's gather).
        self.state.SCB = self.row_scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _DequantLinear.apply(x, self.weight, self.row_scales, bias)
