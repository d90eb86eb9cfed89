"""The training loop, flat: build the step's micro-batches, forward/backward each, one optimizer step,
then log / evaluate / checkpoint / stop as the cadence says. Also what ends a run: the final
evaluation, checkpoint and adapter, a signal, a NaN streak, an out-of-memory step."""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
from pathlib import Path

import torch

from lora_tune.data.batching import collate, pack_best_fit_decreasing, pad_token_id, passes, shard_rows
from lora_tune.engines import common
from lora_tune.engines import ranks as dist
from lora_tune.engines.registry import Engine
from lora_tune.errors import TrainingStopped
from lora_tune.files import write_json
from lora_tune.models.adapter import save_adapter
from lora_tune.training import checkpoint as ckpt
from lora_tune.training.compilation import CompileStats
from lora_tune.training.generation import registry as generation
from lora_tune.training.inputs import RunInputs
from lora_tune.training.metrics import MetricsLog, Progress, peak_memory_bytes
from lora_tune.training.objectives import reference
from lora_tune.training.rewards import RewardError
from lora_tune.training.rollout import Rollout
from lora_tune.training.run_folder import math_config

log = logging.getLogger("lora_tune")

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class TrainingLoop:
    """One loaded run: the inputs, the engine with its model, the trainer state and the metrics log
    (rank 0), all given whole."""

    def __init__(self, inputs: RunInputs, engine: Engine, model, state: ckpt.TrainerState, metrics: MetricsLog | None, started=None):
        """`started`: what the rollout's generator started before the base loaded (a vLLM server), or None."""
        self.inputs, self.cfg = inputs, inputs.cfg
        self.engine, self.model, self.state, self.metrics = engine, model, state, metrics
        tokenizer = inputs.tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.stop_signal: int | None = None
        self.progress: Progress | None = None
        self.last_eval_step: int | None = None
        self.stepped = False  # this process has done a step (memory is reported after the first)
        # --sequence-parallel: the ranks of a group share each micro-batch, each with its slice of every row.
        self.sequence_group = getattr(model, "sequence_group", None)
        self.data_world, self.data_rank = dist.data_parallel(self.sequence_group)
        # --compile: the layers compile lazily, in the first forward; counted from here.
        self.compile_stats = CompileStats() if inputs.cfg.compile else None
        # Online objectives train on what the policy generates (lora_tune.training.rollout).
        self.rollout = None
        if inputs.objective.online:
            self.rollout = Rollout(inputs, model, engine, inputs.rewards, generation.create(inputs, model, engine, started))
        if self.rollout and inputs.resume_from:
            self.rollout.load(inputs.resume_from)

    # --- batches ---------------------------------------------------------------------------------
    def step_batches(self, step: int) -> list:
        """This rank's micro-batches of optimizer step `step`: the global micro-batch sequence is
        dealt out round-robin, so N ranks together see what one process would, in order (the ranks
        of a sequence-parallel group count as one). A micro-batch run in passes (a CPU:
        lora_tune.data.batching.passes) is collated pass by pass."""
        if self.rollout:
            return self.rollout.step_batches(step)
        world, rank = self.data_world, self.data_rank
        first = step * self.cfg.grad_accum
        train = self.inputs.data.train
        tokens = self.inputs.levers.pass_tokens
        micro_batches = [self.inputs.batches.rows(j * world + rank) for j in range(first, first + self.cfg.grad_accum)]
        groups = [part for rows in micro_batches for part in passes(rows, train.lengths, tokens)] if tokens else micro_batches
        return [self._collate(train, rows) for rows in groups]

    def _collate(self, samples, rows: list[list[int]]):
        batch = collate(
            [[samples[i] for i in row] for row in rows],
            self.pad_id,
            self.inputs.levers.packing,
            self.inputs.objective.units,
            self.inputs.image_text,
            blank_image=dist.world_size() > 1,  # ranks run the vision tower in step (lora_tune.data.batching.with_images)
        )
        group = self.sequence_group
        return shard_rows(batch, group.size, group.index, self.pad_id) if group else batch

    def _micro_batch_rows(self, samples) -> list[list[list[int]]]:
        """Every sample once, packed (or one per row), in micro-batches: evaluation's and the reference pass's."""
        row = self.cfg.max_seq_len * self.inputs.objective.sequences_per_unit
        rows = pack_best_fit_decreasing(samples.lengths, row) if self.inputs.levers.packing else [[i] for i in range(len(samples))]
        mbs = self.cfg.micro_batch_size
        return [rows[j : j + mbs] for j in range(0, len(rows), mbs)]

    def eval_batches(self) -> list:
        samples = self.inputs.data.eval
        return [self._collate(samples, rows) for rows in self._micro_batch_rows(samples)]

    # --- the reference policy ------------------------------------------------------------------------
    def prepare_reference(self) -> None:
        """Precomputed reference log-probabilities for every train and eval unit, scored by the model
        as it starts (before any update): read from this run's folder (a resume) or the data cache,
        else computed in one pass, every rank taking its share of the micro-batches."""
        plan = self.inputs.reference
        if plan is None or plan.mode != "precompute":
            return
        data = self.inputs.data
        expected = {
            "train": (len(data.train), self.inputs.objective.sequences_per_unit),
            "eval": (len(data.eval), self.inputs.objective.sequences_per_unit),
        }
        own = self.inputs.output_dir / reference.REFERENCE_FILE
        resume_from = self.inputs.resume_from
        origin = resume_from.parent / reference.REFERENCE_FILE if resume_from else None  # another folder's run, continued here
        for source in (own, origin, plan.cache):
            if source is not None and source.is_file():
                tables = reference.read_tables(source, expected)
                if tables is not None:
                    log.info("reference log-probabilities read from %s", source)
                    break
        else:
            if self.inputs.resume_from and self.cfg.init_adapter:
                raise TrainingStopped(
                    f"the reference log-probabilities of this run ({own.name}, scored by its starting adapter) are missing from "
                    f"{own.parent}; restore the file, or start a new run from --init-adapter {self.cfg.init_adapter}",
                    2,
                    "error",
                )
            t0 = time.perf_counter()
            tables = {"train": self._score(data.train), "eval": self._score(data.eval)}
            log.info(
                "reference log-probabilities of %d + %d units computed in %.1f s", len(data.train), len(data.eval), time.perf_counter() - t0
            )
            if plan.cache is not None and dist.is_main():
                try:
                    reference.write_tables(plan.cache, tables)
                except OSError as e:  # a read-only or full cache: the run keeps its own copy below
                    where, why = plan.cache.parent, e.strerror or e
                    log.warning("reference log-probabilities not cached in %s (%s); this run keeps its own copy", where, why)
        if dist.is_main() and not own.is_file():
            self.inputs.output_dir.mkdir(parents=True, exist_ok=True)
            reference.write_tables(own, tables)
        data.train.reference, data.eval.reference = tables["train"], tables["eval"]

    def _score(self, samples) -> torch.Tensor:
        """[units, sequences] log-probabilities of the model as it is, no gradient; collective."""
        table = torch.zeros(len(samples), self.inputs.objective.sequences_per_unit)
        batches = self._micro_batch_rows(samples)
        if not batches:
            return table
        world, rank = dist.world_size(), dist.rank()
        # Every rank runs as many forwards (ZeRO-3 and FSDP2 gather weights collectively); one past the
        # end repeats an earlier micro-batch and is not kept.
        mine = [k * world + rank for k in range(-(-len(batches) // world))]
        self.model.recorded = []
        try:
            self.engine.evaluate([self._collate(samples, batches[j % len(batches)]) for j in mine])
            recorded = self.model.recorded
        finally:
            self.model.recorded = None
        for j, logps in zip(mine, recorded):
            if j < len(batches):
                units = list(dict.fromkeys(i for row in batches[j] for i in row))
                table[units] = logps.reshape(len(units), -1)
        return dist.all_sum_tensor(table)

    # --- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        previous = {s: signal.signal(s, self._on_signal) for s in EXIT_SIGNAL}
        self.progress = Progress(self.inputs.total_steps, self.state.step) if dist.is_main() else None
        try:
            while self.state.step < self.inputs.total_steps:
                self._one_step()
            if self.compile_stats and self.progress:  # rank 0; graphs of every kind of batch and pass (lora_tune.training.compilation)
                self.progress.write(f"over the run: {self.compile_stats.line()}")
        finally:
            if self.progress:
                self.progress.close()
            self.progress = None
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _one_step(self) -> None:
        cfg, state = self.cfg, self.state
        t0 = time.perf_counter()
        try:
            batches = self.step_batches(state.step)
        except generation.GenerationError as e:  # vLLM stopped answering: one line, the last checkpoint kept
            good = ckpt.newest_complete(self.inputs.output_dir)
            kept = f"the last checkpoint is {good}" if good else "no checkpoint was written before it"
            raise TrainingStopped(
                f"{e} at step {state.step + 1}; {kept}. {e.advice}, then continue with {self.inputs.resume_how}", 1, "error"
            ) from None
        except RewardError as e:  # the user's reward function failed: said in one line, the last checkpoint kept
            good = ckpt.newest_complete(self.inputs.output_dir)
            kept = f"the last checkpoint is {good}" if good else "no checkpoint was written before it"
            how = self.inputs.resume_how
            raise TrainingStopped(
                f"{e} at step {state.step + 1}; {kept}. Fix the function and continue with {how}, allowing the change "
                "(--allow-config-change; the fixed function scores from the first resumed step)",
                1,
                "error",
            ) from None
        # The step's loss is the sum over every label token of every rank, divided by their count.
        # Each rank divides by count / world size, because the backends average gradients over
        # ranks: N ranks then compute exactly what one process would.
        divisor = self._step_totals(batches)
        lr = self.engine.lr  # the rate this step's update uses (the schedule moves on when it is taken)
        try:
            loss = sum(float(self.engine.forward_backward(b, divisor)) for b in batches)
            loss = dist.all_sum(loss) / dist.world_size()  # what is logged: the whole step's loss
            grad_norm, applied = self.engine.step()
        except torch.OutOfMemoryError:
            self._out_of_memory()
        state.step += 1
        if not self.stepped:  # the first step is when layers build their lasting state (bitsandbytes does)
            self.report_memory(f"after step {state.step}")
            self.stepped = True
            if self.compile_stats and self.progress:  # rank 0, above the progress bar
                self.progress.write(f"step {state.step}: {self.compile_stats.line()}")
        objective_metrics = self._objective_metrics()  # every rank, every step: the sums are collective
        step_tokens = int(dist.all_sum(sum(b.tokens for b in batches)))  # the job's, not this rank's
        state.tokens_seen += step_tokens
        seconds = time.perf_counter() - t0
        bad = dist.any_rank(not math.isfinite(loss) or (not applied and not self.engine.skips_overflow))
        state.bad_steps_in_a_row = state.bad_steps_in_a_row + 1 if bad else 0
        peak = peak_memory_bytes(self.inputs.device)
        if self.progress:
            self.progress.update(loss, step_tokens / seconds, peak)
        if self.metrics and (bad or state.step % cfg.logging_steps == 0 or state.step == self.inputs.total_steps):
            self.metrics.write(
                {
                    "step": state.step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": step_tokens / seconds,
                    "peak_memory_bytes": peak,
                    "tokens_seen": state.tokens_seen,
                    "step_seconds": seconds,
                    "skipped": not applied,
                    **objective_metrics,
                }
            )
            if self.rollout:
                self.rollout.write_samples(state.step)
        if self._has_eval() and cfg.eval_steps and state.step % cfg.eval_steps == 0:
            self.evaluate()
        if state.bad_steps_in_a_row >= cfg.max_bad_steps:
            good = ckpt.newest_complete(self.inputs.output_dir)
            where = f"the last good checkpoint is {good}" if good else "no checkpoint was written before it"
            raise TrainingStopped(
                f"loss or gradient norm was NaN/inf for {state.bad_steps_in_a_row} steps in a row (up to step {state.step}); "
                f"{where}. Lower --lr, check the data, or use bf16 instead of fp16",
                3,
            )
        # No periodic save during a bad streak: the newest checkpoint stays the last good one.
        if cfg.save_steps and state.step % cfg.save_steps == 0 and state.step < self.inputs.total_steps and not bad:
            self.save_checkpoint()
        # All ranks agree to stop at the same step, whichever got the signal.
        if dist.any_rank(self.stop_signal is not None):
            path = self.save_checkpoint()
            signum = self.stop_signal or signal.SIGTERM
            raise TrainingStopped(
                f"stopped by {signal.Signals(signum).name} after step {state.step}; checkpoint saved to {path}. "
                f"Continue with {self.inputs.resume_how}",
                EXIT_SIGNAL[signum],
            )

    def _step_totals(self, batches) -> float:
        """What the step's loss is divided by: its micro-batches' counts summed over every rank.
        Each rank divides by the total / world size, because the backends average gradients over
        ranks: N ranks then compute exactly what one process would. Counts other than the
        normalizer reach the loss as `<name>_in_step` inputs."""
        world = dist.world_size()
        totals = {name: dist.all_sum(sum(b.counts[name] for b in batches)) / world for name in batches[0].counts}
        for batch in batches:
            batch.set_step_totals(totals)
        return totals[batches[0].normalizer]

    def _objective_metrics(self, prefix: str = "") -> dict[str, float]:
        """The objective's own measures (rewards, accuracies) since last asked, over every rank."""
        stats = self.model.take_stats()
        return {f"{prefix}{name}": dist.all_sum(total) / max(dist.all_sum(count), 1) for name, (total, count) in sorted(stats.items())}

    def close(self) -> None:
        """What the loop holds beyond the model: the rollout's generator (a vLLM engine)."""
        if self.rollout:
            self.rollout.close()

    def _on_signal(self, signum, frame):  # noqa: ARG002 - signal handler signature
        # Only set a flag: the step in flight finishes, then the loop checkpoints and exits.
        self.stop_signal = signum

    def _out_of_memory(self):
        """The step in flight is dropped (weights and optimizer are still those of the last
        completed step), its state checkpointed, and the plan printed with what to change."""
        self.engine.zero_grad()
        device = self.inputs.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
        path = self.save_checkpoint() if self.state.step > 0 else None
        lines = [f"out of memory at step {self.state.step + 1} on {device}."]
        lines += self.inputs.out_of_memory_advice
        kept = f"checkpoint saved to {path}; continue with {self.inputs.resume_how}"
        lines.append(kept if path else "no step had completed, so nothing was saved")
        raise TrainingStopped("\n".join(lines), 1, "error")

    def report_memory(self, when: str) -> None:
        report = self.engine.memory_report()
        if report:  # every rank: each says what it holds
            print(f"{report}, peak {peak_memory_bytes(self.inputs.device) / 2**30:.2f} GiB ({when})", file=sys.stderr, flush=True)

    # --- evaluation -----------------------------------------------------------------------------------
    def _has_eval(self) -> bool:
        return bool(self.inputs.data.eval or self.inputs.eval_prompts or self.inputs.score_tasks)

    def evaluate(self) -> None:
        """Eval loss (when there is eval data) and sample generations (when there are prompts);
        every rank takes part: under ZeRO-3 and FSDP2 the forward is collective."""
        self.last_eval_step = self.state.step
        lines = []
        if self.inputs.data.eval:
            self.model.take_stats()  # training's, already logged
            total, weight = self.engine.evaluate(self.eval_batches())
            # Summed over ranks: a sequence-parallel rank holds a slice of each row; otherwise every
            # rank scored the same batches, and the ratio is theirs.
            loss = dist.all_sum(total) / max(dist.all_sum(weight), 1)
            result = {"step": self.state.step, "eval_loss": loss, **self._objective_metrics("eval_")}
            if "eval_rewards/accuracies" in result:  # a preference loss: no perplexity, the rewards instead
                measure = f"reward accuracy {result['eval_rewards/accuracies']:.3f}, margin {result['eval_rewards/margins']:.3f}"
            elif self.inputs.objective.name == "sft":
                result["eval_ppl"] = math.exp(min(loss, 50.0))
                measure = f"perplexity {result['eval_ppl']:.2f}"
            else:
                measure = ", ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in result.items() if k not in ("step", "eval_loss"))
            if self.metrics:
                self.metrics.write(result)
            lines.append(f"eval at step {result['step']}: loss {result['eval_loss']:.4f}, {measure}")
        if self.inputs.score_tasks:
            record = {"step": self.state.step, **self.inputs.score_tasks(self.model.peft_model, self.inputs.tokenizer)}
            if self.metrics:
                self.metrics.write(record)
            shown = ", ".join(f"{key.removeprefix('eval_tasks/')} {value:.4f}" for key, value in record.items() if key != "step")
            lines.append(f"eval tasks at step {self.state.step}: {shown}")
        if self.inputs.eval_prompts:
            tokenizer = self.inputs.tokenizer
            completions = common.greedy(self.engine, self.inputs.eval_prompts, self.cfg.eval_max_new_tokens)
            samples = [
                {
                    "prompt": tokenizer.decode(p.ids, skip_special_tokens=True),
                    "completion": tokenizer.decode(c, skip_special_tokens=True),
                    **({"images": list(p.images)} if p.images else {}),
                }
                for p, c in zip(self.inputs.eval_prompts, completions)
            ]
            if self.metrics:
                self.metrics.write({"step": self.state.step, "samples": samples})
            lines.append(f"sample at step {self.state.step}: {samples[0]['prompt'][-60:]!r} -> {samples[0]['completion'][:120]!r}")
        for line in lines if self.metrics else []:
            self.progress.write(line) if self.progress else log.info("%s", line)

    # --- checkpoints and the end ---------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        output_dir, step = self.inputs.output_dir, self.state.step
        adapter = self.engine.adapter_state()  # collective where the adapter is sharded
        try:
            removed = ckpt.write(
                output_dir, step, self.cfg.save_total_limit, self._write_rank_part, lambda folder: self._write_main_part(folder, adapter)
            )
        except OSError as e:
            # Full disk, quota, I/O error: the writer already removed its temp folder, and the
            # checkpoints written before are untouched.
            good = ckpt.newest_complete(output_dir)
            kept = f"{good.name} is intact" if good else "no earlier checkpoint exists"
            raise TrainingStopped(
                f"could not write checkpoint-{step} in {output_dir} ({e.strerror or e}); {kept}. Free space and continue with "
                f"{self.inputs.resume_how}",
                1,
                "error",
            ) from None
        if removed:
            log.info("removed old checkpoint(s): %s", ", ".join(p.name for p in removed))
        return output_dir / f"checkpoint-{step}"

    def _write_rank_part(self, folder: Path) -> None:
        self.engine.save_state(folder)
        if self.rollout:
            self.rollout.save(folder)  # this rank's share of the generation batch in flight

    def _write_main_part(self, folder: Path, adapter: dict) -> None:
        save_adapter(self.model.peft_model, folder, adapter)
        write_json(
            folder / "trainer_state.json",
            {
                **vars(self.state),
                "micro_batches_done": self.state.step * self.cfg.grad_accum * self.data_world,
                "world_size": dist.world_size(),
                "data_fingerprint": self.inputs.data.fingerprint,
                "base_fingerprint": self.inputs.base_fingerprint,
                "math_config": math_config(self.cfg),
                **({"rewards_fingerprint": self.inputs.rewards.fingerprint()} if self.inputs.rewards else {}),
            },
        )

    def finish(self) -> None:
        """The final evaluation (unless the loop just ran it), a final checkpoint (so a later
        --resume can extend the run), then the adapter and tokenizer in the output folder."""
        if self._has_eval() and self.last_eval_step != self.state.step:
            self.evaluate()
        self.save_checkpoint()
        adapter = self.engine.adapter_state()
        if not dist.is_main():
            return
        output_dir = self.inputs.output_dir
        try:
            save_adapter(self.model.peft_model, output_dir, adapter)
        except OSError as e:
            raise TrainingStopped(
                f"could not write the final adapter to {output_dir} ({e.strerror or e}); checkpoint-{self.state.step} holds it. "
                f"Free space and continue with {self.inputs.resume_how}",
                1,
                "error",
            ) from None
        self.inputs.tokenizer.save_pretrained(str(output_dir))
        log.info("adapter written to %s", output_dir)
