"""What `plan` prints: the table of one estimate, the `train` command of a setup, the notes, and the
advice printed on an out-of-memory stop."""

from __future__ import annotations

import shlex
from dataclasses import replace

from lora_tune.engines import registry as engines
from lora_tune.models.loading import unquantized_experts
from lora_tune.planner import speed, vision
from lora_tune.planner.architecture import Architecture
from lora_tune.planner.memory import ELEMENT, GIB, Estimate, Setup

OOM_ADVICE = [
    "a smaller --micro-batch-size with a larger --grad-accum (same effective batch)",
    "--gradient-checkpointing (recompute activations in backward), then --activation-offload (keep its layer inputs in host memory)",
    "the chunked loss: leave --loss-chunk-size at its default, or lower it (never the whole [tokens x vocab] logits)",
    "--optim adamw_8bit (2 B instead of 8 B of optimizer state per LoRA parameter)",
    "--precision 4bit (NF4 base: ~0.52 B per weight instead of 2)",
    "ZeRO-3 with CPU offload across several GPUs",
    "--tiled-mlp on (long rows: the MLP over tiles of the sequence)",
    "--sequence-parallel N across N GPUs (each holds 1/N of every row)",
    "a shorter --max-seq-len",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)",
]


def gib(x: int) -> str:
    return f"{x / GIB:8.2f} GiB"


def size(x: int) -> str:
    """A byte count in the largest unit that keeps it above 1 (a tiny --cpu-memory is not "0.0 GiB")."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x} bytes"


def checkpointing_text(setup: Setup, layers: int) -> str:
    if not setup.gradient_checkpointing:
        return "checkpointing off"
    if not setup.kept_layers:
        return "checkpointing on"
    gain = 1 - speed.checkpointing_cost(setup, layers) / speed.checkpointing_cost(replace(setup, kept_layers=0), layers)
    return f"checkpointing {layers - setup.kept_layers} of {layers} layers (auto; step time ~{gain:.0%} below every layer)"


def table(est: Estimate, setup: Setup, gpu_bytes: int, cpu_bytes: int | None, layers: int = 1) -> str:
    backend = engines.BACKENDS[setup.backend].label(setup.zero)
    unit = "" if setup.sequences_per_unit == 1 else f" x {setup.sequences_per_unit} sequences ({setup.objective})"
    if setup.rollout_sequences:
        unit = f" (prompt) + {setup.new_tokens} generated, {setup.rollout_sequences} completions per rollout ({setup.objective})"
    rows = [
        f"setup: {setup.precision}, rank {setup.rank}, micro-batch {setup.micro_batch_size} x {setup.max_seq_len} tokens{unit}"
        + (f" in passes of {setup.tokens} tokens" if setup.pass_tokens else "")
        + (f", each row split over {setup.sequence_parallel} ranks (sequence parallel)" if setup.sequence_parallel > 1 else "")
        + (f", MLPs in {setup.mlp_tiles} tiles" if setup.mlp_tiles > 1 else "")
        + ", "
        f"{checkpointing_text(setup, layers)}, {setup.optim}, {backend}, offload {setup.offload}, "
        f"{setup.gpus} GPU(s) x {setup.nodes} node(s)",
        f"trainable (LoRA) parameters: {est.trainable_parameters:,}",
        "per device:",
    ]
    for k, v in est.per_device.items():
        rows.append(f"  {k.removesuffix('_bytes'):<13} {gib(v)}")
    rows.append("host:")
    for k, v in est.host.items():
        rows.append(f"  {k.removesuffix('_bytes'):<26} {gib(v)}")
    if setup.reference:
        share = speed.reference_share(setup)
        rows.append(
            f"reference ({setup.objective}): one no-grad forward per unit, without extra memory: precomputed in one pass before "
            f"training (~{share:.0%} of an epoch's time, then cached) when the run covers its data once or more, else in every step "
            f"(+{share:.0%} step time)"
        )
    margin = gpu_bytes - est.per_device["total_bytes"]
    verdict = "fits" if margin >= 0 else "does NOT fit"
    rows.append(f"{verdict} in {size(gpu_bytes)} per GPU ({'spare' if margin >= 0 else 'short by'} {abs(margin) / GIB:.2f} GiB)")
    if cpu_bytes is not None and est.host["total_bytes"] > cpu_bytes:
        rows.append(f"host memory does NOT fit: needs {size(est.host['total_bytes'])} of {size(cpu_bytes)}")
    return "\n".join(rows)


def train_command(base: str, setup: Setup, data: list | None = None, output_dir: str | None = None) -> str:
    """The `train` command of a recommended setup, with the plan's --data and --output-dir when it
    was given them (a data source written as a YAML mapping has no flag form: FILE stands for it)."""
    paths = [d for d in data or [] if isinstance(d, str)]
    where = " ".join(
        [
            "--data " + (" ".join(shlex.quote(d) for d in paths) if paths and len(paths) == len(data) else "FILE"),
            "--output-dir " + (shlex.quote(output_dir) if output_dir else "DIR"),
        ]
    )
    parts = [
        "lora-tune train",
        f"--base {base}",
        f"--precision {setup.precision}",
        f"--rank {setup.rank}",
        f"--micro-batch-size {setup.micro_batch_size}",
        f"--max-seq-len {setup.max_seq_len}",
        f"--optim {setup.optim}",
        *([f"--objective {setup.objective}"] if setup.objective != "sft" else []),
        "--gradient-checkpointing " + ("auto" if setup.kept_layers else "on" if setup.gradient_checkpointing else "off"),
    ]
    if setup.rollout_sequences:  # the step's completions as planned: micro-batches x accumulation
        parts += [f"--grad-accum {setup.rollout_sequences // setup.micro_batch_size}", f"--max-new-tokens {setup.new_tokens}"]
    if setup.activation_offload:
        parts.append("--activation-offload")
    if setup.sequence_parallel > 1:
        parts.append(f"--sequence-parallel {setup.sequence_parallel}")
    if setup.mlp_tiles > 1:
        parts.append("--tiled-mlp on")
    if setup.max_pixels != Setup.max_pixels:
        parts.append(f"--max-pixels {setup.max_pixels}")
    if setup.train_vision:
        parts.append("--train-vision")
    flags = engines.BACKENDS[setup.backend].flags(setup.zero)
    if flags:
        parts += [" ".join(flags), f"--offload {setup.offload}"]
    if setup.nodes > 1:  # one torchrun per node; see the README's multi-node example
        launcher = (
            f"torchrun --nnodes {setup.nodes} --nproc-per-node {setup.gpus} --node-rank RANK --master-addr HOST --master-port 29500 "
            "-m lora_tune train"
        )
        return " ".join([launcher, *parts[1:], where])
    if setup.gpus > 1:
        parts.append(f"--nproc {setup.gpus}")
    return " ".join([*parts, where])


def quantization_note(arch: Architecture, precision: str) -> str | None:
    note = unquantized_experts(precision, arch.expert_params, arch.total)
    return f"note: {note}, and the figures above count them so" if note else None


def recurrent_note(arch: Architecture) -> str | None:
    """Activations are modelled per attention layer: say when some layers are something else."""
    if not arch.recurrent:
        return None
    return (
        f"note: {arch.recurrent} of {arch.layers} layers of {arch.model_type} keep a recurrent state (linear attention / SSM) instead of "
        "attention; their activations are estimated as an attention layer's of the same width (approximate)"
    )


def vision_note(arch: Architecture, setup: Setup) -> str | None:
    """What the plan assumed about an image-text model's images (lora_tune.planner.vision)."""
    return vision.note(arch.vision, setup, ELEMENT[setup.precision])
