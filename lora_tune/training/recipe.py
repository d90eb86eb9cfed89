"""The training recipe: setup -> train -> save -> cleanup.

The recipe is given the run's inputs, every one already checked (`lora_tune.preflight`). `setup`
takes the output folder's lock, has the engine load the base and inject the adapter, and restores
a checkpoint when resuming; `train` runs the loop (`lora_tune.training.loop`); `save` writes the
final checkpoint and adapter; `cleanup` closes the metrics and releases the lock, however the run
ended. The recipe never asks which backend runs, nor which objective trains.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from lora_tune.data.batching import collate, pad_token_id
from lora_tune.engines import ranks as dist
from lora_tune.engines import registry as engines
from lora_tune.models import inits
from lora_tune.models.adapter import add_lora
from lora_tune.models.tiled_mlp import tile_mlps
from lora_tune.training import checkpoint as ckpt
from lora_tune.training import compilation
from lora_tune.training.compilation import compile_regions
from lora_tune.training.generation import registry as generation
from lora_tune.training.inputs import RunInputs
from lora_tune.training.loop import TrainingLoop
from lora_tune.training.metrics import MetricsLog

log = logging.getLogger("lora_tune")


class Recipe:
    def __init__(self, inputs: RunInputs, on_metrics=None):
        self.inputs = inputs
        self.on_metrics = on_metrics
        self.lock: ckpt.OutputLock | None = None
        self.metrics: MetricsLog | None = None
        self.loop: TrainingLoop | None = None
        self.started = None  # what the rollout's generator runs beside the trainer (a vLLM server), stopped at cleanup

    def setup(self) -> None:
        inputs = self.inputs
        cfg = inputs.cfg  # as checked: what the model can't do is turned off there, and said so
        # One writer per output folder; taken after the checks, so bad input writes nothing.
        self.lock = ckpt.OutputLock(inputs.output_dir).acquire() if dist.is_main() else None
        # Only now, with every input checked, the expensive part. The engine decides how the base
        # is loaded and partitioned and when the adapter goes in.
        # Before the base loads: a vLLM server to start (or probe) takes its time meanwhile, and one
        # that can't serve this run stops it before the expensive part.
        self.started = generation.start(inputs)
        engine = engines.create(cfg, inputs.device)
        sequence_group = dist.sequence_group(cfg.sequence_parallel)  # once the ranks are up (the engine started them)

        def loss_module(base):  # what the engine trains: the base with the adapter, inside the objective's loss
            if inputs.mlp_tiles:  # before the adapter: names don't change, LoRA goes into the tiled MLPs' linears
                tile_mlps(base, inputs.mlp_tiles)
            peft_model = add_lora(base, cfg, inputs.base_id, inputs.targets, inputs.checkpointing, lambda: first_batches(inputs))
            loss = inputs.objective.loss_module(peft_model, inputs.levers.loss_chunk_size, cfg)
            if sequence_group:  # the objectives that take it (lora_tune.preflight refuses the others)
                loss.sequence_group = sequence_group
            if cfg.compile:  # after the adapter is in: LoRA's layers are part of each compiled layer
                compile_regions(loss)
            return loss

        model = engine.load(inputs.base_path, loss_module)
        if inputs.resume_from:
            engine.load_adapter(inputs.resume_from)
        elif cfg.init_adapter:
            engine.load_adapter(Path(cfg.init_adapter).expanduser())
        engine.prepare(model, inputs.total_steps)
        state = ckpt.TrainerState()
        if inputs.resume_from:
            engine.load_state(inputs.resume_from)
            state = ckpt.TrainerState.saved(inputs.saved_state)
            log.info("resumed from %s (step %d)", inputs.resume_from, state.step)
        if dist.is_main():
            inputs.output_dir.mkdir(parents=True, exist_ok=True)
            (inputs.output_dir / "lora_tune_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
            # On resume, metrics of steps after the checkpoint are dropped: those steps are redone.
            history = inputs.resume_from.parent / "metrics.jsonl" if inputs.resume_from else None
            self.metrics = MetricsLog(
                inputs.output_dir, cfg.report_to, cfg.model_dump(), state.step if cfg.resume else None, self.on_metrics, history
            )
        self.loop = TrainingLoop(inputs, engine, model, state, self.metrics, self.started)
        self.loop.prepare_reference()
        self.loop.report_memory("after loading")
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        log.info(
            "trainable parameters: %s; %d optimizer steps; %s backend on %s",
            f"{trainable:,}",
            inputs.total_steps,
            engine.spec.name,
            inputs.device,
        )

    def train(self) -> None:
        self.loop.run()

    def save(self) -> None:
        self.loop.finish()

    def cleanup(self) -> None:
        if self.loop:
            self.loop.close()
        if self.started:
            self.started.close()
        if self.metrics:
            self.metrics.close()
        if self.lock:
            self.lock.release()


def first_batches(inputs: RunInputs) -> list[dict]:
    """The run's first --init-batches micro-batches as model inputs, one sequence a row with its
    attention mask and labels: what an init that learns from the data reads (lora_tune.models.data_inits)."""
    tokenizer, samples = inputs.tokenizer, inputs.data.train
    pad_id = pad_token_id(tokenizer)
    count = min(inits.init_batches(inputs.cfg), len(inputs.batches))
    batches = []
    for j in range(count):
        rows = [[samples[i] for i in row] for row in inputs.batches.rows(j)]
        batches.append(collate(rows, pad_id, False, image_text=inputs.image_text, blank_image=False).inputs)
    return batches


def run(inputs: RunInputs, on_metrics=None) -> None:
    """setup -> train -> save -> cleanup. `on_metrics`: called with each metrics record (rank 0)."""
    recipe = Recipe(inputs, on_metrics)
    try:
        with compilation.settings(inputs.cfg.compile):
            recipe.setup()
            recipe.train()
            recipe.save()
        dist.release_sequence_groups()  # a finished run's; after a failure the process ends with its groups
    finally:
        recipe.cleanup()
