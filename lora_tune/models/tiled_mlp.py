"""--tiled-mlp: each decoder layer's MLP computed over consecutive tiles of the sequence, every tile
recomputed in backward (non-reentrant checkpointing), as DeepSpeed's ALST does. The MLP works token
by token, so the numbers are the untiled ones; what changes is memory: a row of 100k tokens never
holds its [tokens x intermediate] activations (three of them in a SwiGLU MLP, the largest a layer
has), only one tile's, while the layer keeps the MLP's input. The price is one more forward of the
MLP per step.

The tile wrapper takes the MLP's place in its layer but shares the MLP's own tables of parameters,
buffers and submodules, so parameter names, state dicts and the adapter's keys are the untiled
model's (peft's LoRA layers injected into either are in both). The number of tiles is fixed for the
run (from the longest row a rank holds), the same on every rank: ZeRO-3 gathers a linear's weight
each time it runs, collectively, so every rank must run as many tiles.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from lora_tune.models.structure import block_modules

TILE_TOKENS = 1024  # fewest tokens per tile: below it a CPU's or GPU's matmuls lose speed


class TiledMLP(torch.nn.Module):
    """An MLP over `tiles` consecutive slices of the sequence dimension."""

    def __init__(self, mlp: torch.nn.Module, tiles: int):
        super().__init__()
        object.__setattr__(self, "mlp", mlp)  # not a submodule: its submodules are this module's own, below
        self._parameters, self._buffers, self._modules = mlp._parameters, mlp._buffers, mlp._modules
        self.tiles = tiles

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation keeps nothing for backward: tiles would only cost time
            return self.mlp(hidden)
        pieces = hidden.tensor_split(self.tiles, dim=-2)  # exactly `tiles` pieces (empty ones run too: every rank alike)
        return torch.cat([checkpoint(self.mlp, piece, use_reentrant=False) for piece in pieces], dim=-2)


def tile_count(row_tokens: int, hidden: int) -> int:
    """Tiles for a row of `row_tokens` tokens on one rank: tiles of max(hidden size, TILE_TOKENS)
    tokens (ALST takes the hidden size: a tile's activations then about match the MLP's weights)."""
    return max(1, math.ceil(row_tokens / max(hidden, TILE_TOKENS)))


def refusal(config) -> str | None:
    """Why this model's MLPs can't be tiled, or None: a mixture of experts routes tokens (its block
    returns router scores too), which the tiles would split."""
    text = config.get_text_config(decoder=True)
    experts = next((getattr(text, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(text, k, None)), None)
    if experts:
        return f"{config.model_type} is a mixture of experts ({experts} experts), whose MLP blocks route tokens"
    return None


def tile_mlps(model, tiles: int) -> int:
    """Put every decoder layer's `mlp` in a TiledMLP of `tiles` tiles; returns how many were tiled."""
    count = 0
    for _, layer in list(block_modules(model)):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, torch.nn.Module) and not isinstance(mlp, TiledMLP):
            layer.mlp = TiledMLP(mlp, tiles)
            count += 1
    return count
