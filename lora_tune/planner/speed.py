"""A deliberately simple throughput model for ranking setups (`plan --auto`): the cost of each
choice as a multiplier on step time, from published comparisons (QLoRA paper, LLaMA-Factory and
DeepSpeed docs); the backends declare their own (`BackendSpec.slowdown`). Good enough to rank
setups; not a prediction of absolute speed."""

from __future__ import annotations

from lora_tune.engines import registry as engines
from lora_tune.planner.records import Setup

SLOWDOWN = {
    "precision": {"bf16": 1.0, "fp16": 1.0, "fp32": 2.5, "8bit": 1.6, "4bit": 1.3},
    "activation_offload": {False: 1.0, True: 1.1},  # a device-to-host copy per layer in forward, back in backward
}
# Sequence parallelism: four all-to-alls per layer in forward (q, k, v, output), four in backward, and
# again in a recomputed forward; ALST reports ~10-15% at 8 GPUs within a node. Tiled MLPs: one more
# MLP forward, about a fifth of a layer's forward + backward.
SEQUENCE_PARALLEL_COST = 1.15
TILED_MLP_COST = 1.07
RECOMPUTE = 1 / 3  # checkpointing every layer: one more forward, a third of forward + backward


def checkpointing_cost(setup: Setup, layers: int) -> float:
    """Step time relative to no checkpointing: the recomputed share of the layers' forward."""
    if not setup.gradient_checkpointing:
        return 1.0
    return 1 + RECOMPUTE * (layers - min(setup.kept_layers, layers)) / layers


def relative_speed(setup: Setup, layers: int = 1) -> float:
    """Relative tokens/s of the whole job: more GPUs help, small micro-batches leave each underused.
    `layers`: the model's decoder layers (what a partial checkpointing is a share of)."""
    utilisation = min(1.0, setup.tokens / 8192) ** 0.3
    cost = (
        SLOWDOWN["precision"][setup.precision]
        * checkpointing_cost(setup, layers)
        * engines.BACKENDS[setup.backend].slowdown(setup.zero, setup.offload)
        * SLOWDOWN["activation_offload"][setup.activation_offload]
        * (SEQUENCE_PARALLEL_COST if setup.sequence_parallel > 1 else 1.0)
        * (TILED_MLP_COST if setup.mlp_tiles > 1 else 1.0)
    )
    return setup.world * utilisation / cost


def reference_share(setup: Setup) -> float:
    """The reference policy's no-grad forward as a share of a training step's time: a step is a
    forward and a backward of twice its cost, plus the recomputed forward under checkpointing."""
    return 1 / (3 + setup.gradient_checkpointing)
