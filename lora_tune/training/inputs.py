"""What a run is given: its inputs, every one checked before a weight is loaded (built by
`lora_tune.preflight.check_inputs`). The recipe and the loop only ever read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lora_tune.data.batching import MicroBatches
from lora_tune.data.prepare import PreparedData
from lora_tune.models.adapter import Checkpointing
from lora_tune.models.targets import Targets
from lora_tune.training.objectives.reference import ReferencePlan
from lora_tune.training.objectives.registry import Objective
from lora_tune.training.rewards import Rewards
from lora_tune.training.tools import Toolbox

if TYPE_CHECKING:
    from lora_tune.config import TrainConfig


@dataclass(frozen=True)
class SpeedLevers:
    """Packing, the chunked loss, the attention kernels and the passes per micro-batch as they apply
    to this model and machine."""

    packing: bool
    loss_chunk_size: int | None  # None: per micro-batch (auto); 0: the model's own full-logits loss
    attention: str
    # Padded tokens per forward + backward pass (lora_tune.data.batching.passes): on a CPU, a micro-batch's
    # rows in passes of up to this many; None: the whole micro-batch in one pass.
    pass_tokens: int | None = None


@dataclass(frozen=True)
class RunInputs:
    """The checked inputs of one run, fully built before anything heavy is loaded."""

    cfg: TrainConfig
    output_dir: Path
    resume_from: Path | None  # the checkpoint to continue from
    saved_state: dict | None  # its trainer_state.json
    base_path: str  # what from_pretrained takes
    base_id: str  # what the adapter records as its base
    base_fingerprint: str | None  # of its config and safetensors headers (None: a hub id not in the local cache)
    tokenizer: object
    device: torch.device
    targets: Targets | None  # None: remote code, resolved on the loaded model
    levers: SpeedLevers
    data: PreparedData
    eval_prompts: list  # lora_tune.data.prompts.EvalPrompt
    batches: MicroBatches
    total_steps: int
    objective: Objective
    reference: ReferencePlan | None  # how the reference log-probabilities are computed (objectives that compare with one)
    checkpointing: Checkpointing  # which decoder layers recompute their activations
    mlp_tiles: int = 0  # --tiled-mlp: tiles per decoder layer's MLP (lora_tune.models.tiled_mlp); 0: untiled
    # What an out-of-memory stop prints: the memory plan's table and what to change (empty when the
    # architecture can't be read offline).
    out_of_memory_advice: tuple[str, ...] = ()
    # --eval-tasks: scores (peft model, tokenizer) on lm-eval tasks -> metrics record (lora_tune.after.evaluation).
    score_tasks: Callable[[object, object], dict[str, float]] | None = None
    # --objective grpo: the reward functions, loaded and checked (lora_tune.training.rewards).
    rewards: Rewards | None = None
    # --tools / --environment: what the policy may call and act in (lora_tune.training.tools); None without.
    toolbox: Toolbox | None = None
    # Image-text data: the base's processor (lora_tune.models.processors.ImageText), which builds each
    # micro-batch's pixel inputs; None when no training row has an image.
    image_text: object | None = None
    # How a stopped run is continued, as its messages say it: the CLI's; the Python API names its call.
    resume_how: str = "the same command plus --resume"
