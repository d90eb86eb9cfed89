"""The records the planner's modules share, below all of them: `Setup` (one training setup as the
planner sees it: what `train` would run) and `VisionTower` (what an image-text model holds outside
its language model). `architecture` reads a tower, `vision` and `memory` count a setup's bytes:
none of them imports another for these."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Setup:
    precision: str = "bf16"
    rank: int = 16
    target_modules: tuple[str, ...] | None = None  # None: the default targets (every linear layer of the blocks, experts)
    micro_batch_size: int = 1
    max_seq_len: int = 2048
    gradient_checkpointing: bool = True
    kept_layers: int = 0  # with checkpointing: decoder layers (the last ones) that keep their activations
    optim: str = "adamw_8bit"
    loss_chunk_size: int | None = None  # None: lora_tune.models.head.auto_chunk_size; 0: full logits
    activation_offload: bool = False
    backend: str = "single"
    zero: int = 0
    offload: str = "none"
    gpus: int = 1
    nodes: int = 1
    objective: str = "sft"
    sequences_per_unit: int = 1  # preference objectives score two sequences (chosen, rejected) per unit
    reference: bool = False  # the objective scores the reference policy too (one no-grad forward per unit)
    new_tokens: int = 0  # online RL: tokens generated per completion (--max-new-tokens), trained after the prompt
    rollout_sequences: int = 0  # online RL: completions generated at once (a step's: micro-batch x grad-accum)
    rollout: str = "transformers"  # what generates them (lora_tune.training.generation.registry.name)
    turn_tokens: int = 0  # tools (--tools / --environment): a later turn decodes this many more after the episode so far
    pass_tokens: int | None = None  # a CPU's passes: padded tokens per forward + backward pass; None: a micro-batch per pass
    sequence_parallel: int = 1  # ranks sharing every row (--sequence-parallel): each holds 1/N of its tokens
    mlp_tiles: int = 0  # --tiled-mlp: tiles of each decoder layer's MLP (0: untiled)
    # The attention implementation (lora_tune.models.loading.attention_implementation): sdpa, sdpa_packed
    # and eager get a [tokens x tokens] mask per row from transformers; flash-attention and
    # sequence parallelism's attention (ulysses_*) none.
    attention: str = "flash_attention_2"
    max_pixels: int = 1024 * 1024  # --max-pixels: image-text models' largest image (lora_tune.planner.vision)
    train_vision: bool = False  # --train-vision: LoRA on the vision tower, its activations kept for backward
    # Element counts of the tensors an adapter that is not a uniform LoRA trains (another --peft-type,
    # rank patterns, layer lists, trainable tokens, modules kept in full), counted by peft on a meta
    # skeleton (lora_tune.models.adapter.trained_sizes); None: a LoRA of --rank, counted from the shapes.
    adapter_sizes: tuple[int, ...] | None = None
    # Bytes per trained element the adapter type keeps beside the optimizer (AdaLoRA's allocator: three fp32 scores).
    adapter_state_bytes: int = 0
    # Bytes of the adapter's fixed tensors, whole on every rank (BOFT's permutation matrices).
    adapter_fixed_bytes: int = 0

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def row_tokens(self) -> int:
        """A row's tokens on one rank: packing fills rows to max_seq_len (per sequence of a unit),
        the worst case without it; under sequence parallelism each rank holds 1/N of the row."""
        return math.ceil((self.max_seq_len + self.new_tokens) * self.sequences_per_unit / self.sequence_parallel)

    @property
    def tokens(self) -> int:
        """Per forward + backward pass on one rank (a micro-batch, or on a CPU the full rows a pass
        holds). A pair's reference forward (per step, no gradient) runs one layer at a time and
        peaks below training's backward, so it adds time, not memory."""
        row = self.row_tokens
        rows = self.micro_batch_size if self.pass_tokens is None else min(self.micro_batch_size, max(1, self.pass_tokens // row))
        return rows * row


@dataclass(frozen=True)
class VisionTower:
    """What an image-text model holds outside its language model, and the shapes its forward uses."""

    params: int  # every parameter of the tower and the projector, once
    quantized: tuple[tuple[int, int], ...]  # (in, out) of the linear layers bitsandbytes quantizes in 8/4-bit loads
    linears: tuple[tuple[str, int, int], ...]  # (short name, in, out) of every plain linear layer (--train-vision's LoRA)
    layers: int  # the tower's blocks
    width: int  # w: its hidden size
    intermediate: int  # i: its MLP's width
    heads: int
    gated: bool
    one_op_activation: bool
    rotary: bool  # rotary positions (Qwen2-VL, Pixtral): q, k and their rotated copies in the attention
    patch: int  # pixels per patch side
    channels: int
    temporal: int  # frames per patch (Qwen2-VL's temporal_patch_size: an image is repeated)
    image_size: int | None  # fixed-size families: every image is resized to it; None: dynamic resolution
    merge: int  # patches per side merged into one language-model token
    tokens_per_image: int | None  # language-model tokens per image where the config fixes them (Gemma 3)
