"""The training recipe: setup -> train -> save -> cleanup.

Everything that can be wrong with the user's input is checked in `setup` before the weights are
loaded (config, output folder, base, tokenizer, the whole dataset, resume compatibility). The loop
itself is flat: build the step's micro-batches, forward/backward each, one optimizer step, then
log / evaluate / checkpoint / stop as the cadence says.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from lora_tune import checkpoint as ckpt
from lora_tune import distributed as dist
from lora_tune import engines
from lora_tune.adapter import Targets, add_lora, meta_model, resolve_targets, save_adapter
from lora_tune.aliases import resolve_base
from lora_tune.config import TrainConfig
from lora_tune.batching import MicroBatches, collate, pack_best_fit_decreasing
from lora_tune.data import PreparedData, prepare_data
from lora_tune.data.prompts import read_eval_prompts
from lora_tune.errors import UserError
from lora_tune.metrics import MetricsLog, Progress, check_reporter, peak_memory_bytes
from lora_tune.loss import CausalLMLoss, chunking_refusal
from lora_tune.model_loading import attention_implementation, load_config, load_tokenizer, model_class, packing_refusal, pick_device

log = logging.getLogger("lora_tune")

RUN_FILES = ("lora_tune_config.yaml", "adapter_config.json", "metrics.jsonl")
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class TrainingStopped(Exception):
    """The run ended early but cleanly (signal, repeated NaN, a checkpoint that could not be
    written); carries the exit code and whether it is an error or a requested stop."""

    def __init__(self, message: str, exit_code: int, label: str = "stopped"):
        super().__init__(message)
        self.exit_code = exit_code
        self.label = label


@dataclass
class RunState:
    """What, besides the engine state, an exact resume needs (saved as trainer_state.json)."""

    step: int = 0
    tokens_seen: int = 0
    bad_steps_in_a_row: int = 0
    best_eval_loss: float | None = None


def total_steps(cfg: TrainConfig, micro_batches_per_epoch: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * micro_batches_per_epoch / (cfg.grad_accum * dist.world_size())))


def math_config(cfg: TrainConfig) -> dict:
    return {k: getattr(cfg, k) for k in TrainConfig.math_keys()}


# --- setup --------------------------------------------------------------------------------------
def check_output_dir(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """The output folder, and the checkpoint to resume from (None for a fresh run)."""
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir: {out} is a file; give a folder")
    complete, incomplete = ckpt.list_checkpoints(out)
    if not dist.is_main():
        # Rank 0 judges the folder (and takes its lock) for the job; by the time another rank looks,
        # rank 0 may already have written this run's first files there.
        return out, complete[-1] if cfg.resume and complete else None
    holder = ckpt.lock_holder(out)
    if holder:
        raise UserError(f"--output-dir: {out} is being written by another lora-tune run ({holder}); wait for it to end or choose another --output-dir")
    holds_run = bool(complete or incomplete) or any((out / f).exists() for f in RUN_FILES)
    if not cfg.resume:
        if holds_run:
            raise UserError(f"--output-dir: {out} already holds a run; pass --resume to continue it, or choose another --output-dir")
        return out, None
    if not complete:
        ckpt.remove_leftovers(out)
        if holds_run:
            # Killed before its first checkpoint: there is nothing to lose, so start over.
            log.warning("no complete checkpoint in %s (%d incomplete ignored); starting from step 0", out, len(incomplete))
            return out, None
        raise UserError(f"--resume: no run to resume in {out}; start without --resume or point --output-dir at the run")
    leftovers = ckpt.remove_leftovers(out)
    if leftovers:
        log.info("removed %d temporary folder(s) left by an interrupted save", len(leftovers))
    newer_incomplete = [p.name for p in incomplete if int(p.name.split("-")[1]) > int(complete[-1].name.split("-")[1])]
    if newer_incomplete:
        log.warning("ignoring incomplete checkpoint(s) %s (no %s marker)", ", ".join(newer_incomplete), ckpt.MARKER)
    return out, complete[-1]


def check_resume_compatible(cfg: TrainConfig, data: PreparedData, checkpoint_dir: Path) -> dict:
    state = ckpt.read_json(checkpoint_dir / "trainer_state.json")
    saved = state.get("math_config", {})
    now = math_config(cfg)
    differing = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if state.get("data_fingerprint") != data.fingerprint:
        differing.append("data content (fingerprint)")
    if differing and not cfg.allow_config_change:
        details = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" if k in now else k for k in differing)
        raise UserError(f"--resume: the run in {checkpoint_dir.parent} was trained with other settings ({details}); restore them, or pass --allow-config-change")
    if differing:
        log.warning("resuming with changed settings (--allow-config-change): %s", ", ".join(differing))
    return state


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU runs live in host RAM


def preflight(cfg: TrainConfig, device: torch.device):
    """The memory plan for this run, before loading: a warning (or with --strict-memory an error)
    when it will not fit. Returns (estimate, available bytes), or None when the architecture
    can't be read offline."""
    from lora_tune import planner as plan

    try:
        arch = plan.load_architecture(cfg.base)
    except UserError as e:
        log.info("memory plan skipped: %s", e)
        return None
    estimate = plan.estimate(arch, plan.setup_from(cfg))
    need, have = estimate.per_device["total_bytes"], device_memory_bytes(device)
    log.info("memory plan: %.2f GiB of %.2f GiB on %s", need / plan.GIB, have / plan.GIB, device)
    if need > have:
        message = f"the memory plan needs {need / plan.GIB:.1f} GiB but {device} has {have / plan.GIB:.1f} GiB; run `lora-tune plan --auto` with these options for a setup that fits"
        if cfg.strict_memory:
            raise UserError(f"--strict-memory: {message}")
        log.warning("warning: %s", message)
    return estimate, have


class Recipe:
    def __init__(self, cfg: TrainConfig, on_metrics=None):
        self.cfg = cfg
        self.on_metrics = on_metrics
        self.stop_signal: int | None = None
        self.progress = None
        self.last_eval_step: int | None = None

    def check_inputs(self) -> None:
        """Everything about the user's input, before any weight is loaded (also run by the
        `--nproc` launcher, so a bad input fails once, in one line, before processes start)."""
        cfg = self.cfg
        engines.check_compatibility(cfg)
        check_reporter(cfg.report_to)
        self.output_dir, self.resume_from = check_output_dir(cfg)
        self.base_path = resolve_base(cfg.base)
        self.base_id = self.base_path if not Path(self.base_path).is_dir() else str(Path(self.base_path).resolve())
        self.tokenizer = load_tokenizer(self.base_path, cfg.trust_remote_code)
        self.device = pick_device()
        self.check_speed_levers()
        self.data = prepare_data(cfg, self.tokenizer)
        if len(self.data.per_source) > 1:
            for line in self.data.per_source:
                log.info("data source %s", line)
        log.info("data: %s format, %s; %d train / %d eval samples", self.data.format, self.data.stats.summary(), len(self.data.train), len(self.data.eval))
        self.eval_prompts = read_eval_prompts(cfg.eval_prompts, self.tokenizer, cfg.system_message) if cfg.eval_prompts else []
        saved_state = check_resume_compatible(cfg, self.data, self.resume_from) if self.resume_from else None
        self.batches = MicroBatches(self.data.train.lengths, cfg.micro_batch_size, cfg.seed, self.packing, cfg.group_by_length, cfg.max_seq_len)
        if self.packing:
            tokens = sum(self.data.train.lengths)
            log.info("packing: %d samples in %d rows of up to %d tokens (%.0f%% full)", len(self.data.train), self.batches.n_rows, cfg.max_seq_len,
                     100 * tokens / (self.batches.n_rows * cfg.max_seq_len))
        self.total_steps = total_steps(cfg, len(self.batches))
        self.saved_state = saved_state
        self.plan = preflight(cfg, self.device)

    def lora_targets(self, config) -> Targets | None:
        """--target-modules resolved on a meta skeleton of the model (shapes only, no weights), so a
        bad name or an unsupported combination fails before loading; what is adapted is logged."""
        if model_class(config) is None:
            return None  # remote code: resolved on the loaded model
        skeleton = meta_model(config)
        targets = resolve_targets(skeleton, self.cfg)
        log.info("LoRA targets: %s", targets.describe(skeleton))
        from lora_tune.planner import unquantized_experts

        fused = sum(p.numel() for p in skeleton.parameters() if p.dim() == 3)
        note = unquantized_experts(self.cfg.precision, fused, sum(p.numel() for p in skeleton.parameters()))
        if note:
            log.warning(note)
        return targets

    def check_speed_levers(self) -> None:
        """Packing, the chunked loss, activation offload and the attention kernels, checked against
        this model and machine from its config alone; what can't apply says so in one line."""
        cfg = self.cfg
        config = load_config(self.base_path, cfg.trust_remote_code)
        engines.check_layer_by_layer(cfg, config.model_type)
        self.targets = self.lora_targets(config)
        attention = attention_implementation(cfg.attn_implementation, config, self.device)
        self.packing = cfg.packing
        reason = packing_refusal(config) if cfg.packing else None
        if reason:
            log.warning("packing off: %s; training on padded batches instead (pass --no-packing to silence this)", reason)
            self.packing = False
        self.loss_chunk_size = cfg.loss_chunk_size
        reason = chunking_refusal(config) if cfg.loss_chunk_size != 0 else None
        if reason:
            log.warning("chunked loss off: %s, which the chunked loss does not reproduce; computing the full logits instead", reason)
            self.loss_chunk_size = 0
        if cfg.activation_offload and not cfg.gradient_checkpointing:
            raise UserError("--activation-offload moves the inputs that gradient checkpointing keeps: it needs --gradient-checkpointing")
        if cfg.activation_offload and self.device.type != "cuda":
            raise UserError(f"--activation-offload needs a CUDA GPU (on {self.device} the activations already live in host memory); leave it out")
        chunks = "full logits" if self.loss_chunk_size == 0 else f"chunked ({self.loss_chunk_size or 'auto'} tokens per chunk)"
        log.info("attention: %s; packing %s; loss %s", attention, "on" if self.packing else "off", chunks)

    def setup(self) -> None:
        cfg = self.cfg
        self.check_inputs()
        # One writer per output folder; taken after the checks, so bad input writes nothing.
        self.lock = ckpt.OutputLock(self.output_dir).acquire() if dist.is_main() else None
        # Only now, with every input checked, the expensive part. The engine decides how the base
        # is loaded and partitioned and when the adapter goes in.
        self.engine = engines.create(cfg, self.device)
        self.model = self.engine.load(self.base_path, lambda base: CausalLMLoss(add_lora(base, cfg, self.base_id, self.targets), self.loss_chunk_size))
        self.state = RunState()
        if self.saved_state:
            self.engine.load_adapter(self.resume_from)
        self.engine.prepare(self.model, self.total_steps)
        self._report_memory("after loading")
        if self.saved_state:
            self.engine.load_state(self.resume_from)
            self.state = RunState(**{k: self.saved_state[k] for k in ("step", "tokens_seen", "bad_steps_in_a_row", "best_eval_loss")})
            log.info("resumed from %s (step %d)", self.resume_from, self.state.step)
        self.metrics = None
        if dist.is_main():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "lora_tune_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
            # On resume, metrics of steps after the checkpoint are dropped: those steps are redone.
            self.metrics = MetricsLog(self.output_dir, cfg.report_to, cfg.model_dump(), self.state.step if cfg.resume else None, self.on_metrics)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters() if p.requires_grad)
        log.info("trainable parameters: %s; %d optimizer steps; %s backend on %s", f"{trainable:,}", self.total_steps, self.engine.name, self.device)

    def _report_memory(self, when: str) -> None:
        report = self.engine.memory_report()
        if report:  # every rank: each says what it holds
            print(f"{report}, peak {peak_memory_bytes(self.device) / 2**30:.2f} GiB ({when})", file=sys.stderr, flush=True)

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        try:
            return self._write_checkpoint()
        except OSError as e:
            # Full disk, quota, I/O error: the writer already removed its temp folder, and the
            # checkpoints written before are untouched.
            good = ckpt.newest_complete(self.output_dir)
            kept = f"{good.name} is intact" if good else "no earlier checkpoint exists"
            raise TrainingStopped(f"could not write checkpoint-{self.state.step} in {self.output_dir} ({e.strerror or e}); {kept}. Free space and rerun with --resume", 1, "error") from None

    def _write_checkpoint(self) -> Path:
        """Rank 0 opens the temporary folder, every rank writes its engine's part, rank 0 adds
        the adapter and trainer state and commits. A failure on any rank aborts the folder on
        every rank (all agree first, so none waits in a barrier for a rank that gave up)."""
        adapter = self.engine.adapter_state()  # collective where the adapter is sharded
        writer = ckpt.CheckpointWriter(self.output_dir, self.state.step)
        if dist.is_main():
            writer.begin()
        dist.barrier()
        error = None
        try:
            self.engine.save_state(writer.tmp)
            if dist.is_main():
                save_adapter(self.model.peft_model, writer.tmp, adapter)
                self._write_trainer_state(writer.tmp)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agreed
            error = e
        if dist.any_rank(error is not None):  # every rank's part is written (or none commits)
            if dist.is_main():
                writer.abort()
            raise error or OSError(f"another rank could not write its part of checkpoint-{self.state.step}")
        if dist.is_main():
            try:
                writer.commit()  # aborts its folder itself on failure
            except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agreed
                error = e
        if dist.any_rank(error is not None):
            raise error or OSError(f"rank 0 could not commit checkpoint-{self.state.step}")
        if dist.is_main():
            removed = ckpt.rotate(self.output_dir, self.cfg.save_total_limit)
            if removed:
                log.info("removed old checkpoint(s): %s", ", ".join(p.name for p in removed))
        return self.output_dir / f"checkpoint-{self.state.step}"

    def _write_trainer_state(self, tmp: Path) -> None:
        ckpt.write_json(tmp / "trainer_state.json", {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "bad_steps_in_a_row": self.state.bad_steps_in_a_row,
            "best_eval_loss": self.state.best_eval_loss,
            "micro_batches_done": self.state.step * self.cfg.grad_accum * dist.world_size(),
            "world_size": dist.world_size(),
            "data_fingerprint": self.data.fingerprint,
            "math_config": math_config(self.cfg),
        })

    # --- the loop ------------------------------------------------------------------------------
    def _step_batches(self, step: int) -> list:
        """This rank's micro-batches of optimizer step `step`: the global micro-batch sequence is
        dealt out round-robin, so N ranks together see what one process would, in order."""
        world, rank = dist.world_size(), dist.rank()
        first = step * self.cfg.grad_accum
        train = self.data.train
        return [collate([[train[i] for i in row] for row in self.batches.rows(j * world + rank)], self.pad_id, self.packing)
                for j in range(first, first + self.cfg.grad_accum)]

    def _evaluate(self) -> dict:
        samples, mbs = self.data.eval, self.cfg.micro_batch_size
        if self.packing:
            rows = pack_best_fit_decreasing(samples.lengths, self.cfg.max_seq_len)
        else:
            rows = [[i] for i in range(len(samples))]
        batches = [collate([[samples[i] for i in row] for row in rows[j : j + mbs]], self.pad_id, self.packing) for j in range(0, len(rows), mbs)]
        total, tokens = self.engine.evaluate(batches)
        loss = total / max(tokens, 1)
        return {"step": self.state.step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def _on_signal(self, signum, frame):  # noqa: ARG002 - signal handler signature
        # Only set a flag: the step in flight finishes, then the loop checkpoints and exits.
        self.stop_signal = signum

    def train(self) -> None:
        cfg, state = self.cfg, self.state
        previous = {s: signal.signal(s, self._on_signal) for s in EXIT_SIGNAL}
        progress = self.progress = Progress(self.total_steps, state.step) if dist.is_main() else None
        reported = False
        try:
            while state.step < self.total_steps:
                t0 = time.perf_counter()
                batches = self._step_batches(state.step)
                # The step's loss is the sum over every label token of every rank, divided by their
                # count. Each rank divides by count / world size, because the backends average
                # gradients over ranks: N ranks then compute exactly what one process would.
                n_labels = dist.all_sum(sum(b.label_tokens for b in batches))
                divisor = n_labels / dist.world_size() if dist.world_size() > 1 else n_labels
                try:
                    loss = sum(float(self.engine.forward_backward(b, divisor)) for b in batches)
                    loss = dist.all_sum(loss) / dist.world_size()  # what is logged: the whole step's loss
                    grad_norm, applied = self.engine.step()
                except torch.OutOfMemoryError:
                    self._out_of_memory()
                state.step += 1
                if not reported:  # the first step is when layers build their lasting state (bitsandbytes does)
                    self._report_memory(f"after step {state.step}")
                    reported = True
                step_tokens = sum(b.tokens for b in batches)
                state.tokens_seen += step_tokens
                seconds = time.perf_counter() - t0
                bad = dist.any_rank(not math.isfinite(loss) or (not applied and not self.engine.skips_overflow))
                state.bad_steps_in_a_row = state.bad_steps_in_a_row + 1 if bad else 0
                peak = peak_memory_bytes(self.device)
                if progress:
                    progress.update(loss, step_tokens / seconds, peak)
                if self.metrics and (bad or state.step % cfg.logging_steps == 0 or state.step == self.total_steps):
                    self.metrics.write({
                        "step": state.step, "loss": loss, "lr": self.engine.lr, "grad_norm": grad_norm,
                        "tokens_per_s": step_tokens / seconds, "peak_memory_bytes": peak,
                        "tokens_seen": state.tokens_seen, "step_seconds": seconds, "skipped": not applied,
                    })
                if (self.data.eval or self.eval_prompts) and cfg.eval_steps and state.step % cfg.eval_steps == 0:
                    self._write_eval()
                if state.bad_steps_in_a_row >= cfg.max_bad_steps:
                    good = ckpt.newest_complete(self.output_dir)
                    where = f"the last good checkpoint is {good}" if good else "no checkpoint was written before it"
                    raise TrainingStopped(f"loss or gradient norm was NaN/inf for {state.bad_steps_in_a_row} steps in a row (up to step {state.step}); {where}. Lower --lr, check the data, or use bf16 instead of fp16", 3)
                # No periodic save during a bad streak: the newest checkpoint stays the last good one.
                if cfg.save_steps and state.step % cfg.save_steps == 0 and state.step < self.total_steps and not bad:
                    self.save_checkpoint()
                # All ranks agree to stop at the same step, whichever got the signal.
                if dist.any_rank(self.stop_signal is not None):
                    path = self.save_checkpoint()
                    signum = self.stop_signal or signal.SIGTERM
                    raise TrainingStopped(f"stopped by {signal.Signals(signum).name} after step {state.step}; checkpoint saved to {path}. Continue with the same command plus --resume", EXIT_SIGNAL[signum])
        finally:
            if progress:
                progress.close()
            self.progress = None
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _out_of_memory(self):
        """The step in flight is dropped (weights and optimizer are still those of the last
        completed step), its state checkpointed, and the plan printed with what to change."""
        from lora_tune import planner as plan

        self.engine.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        path = self.save_checkpoint() if self.state.step > 0 else None
        lines = [f"out of memory at step {self.state.step + 1} on {self.device}."]
        if self.plan:
            estimate, have = self.plan
            lines.append(plan.table(estimate, plan.setup_from(self.cfg), have, None))
        lines.append("try, in this order: " + "; ".join(plan.OOM_ADVICE))
        lines.append(f"checkpoint saved to {path}; continue with --resume" if path else "no step had completed, so nothing was saved")
        raise TrainingStopped("\n".join(lines), 1, "error")

    # --- save and cleanup ------------------------------------------------------------------------
    def _write_eval(self) -> None:
        """Eval loss (when there is eval data) and sample generations (when there are prompts);
        every rank takes part: under ZeRO-3 and FSDP2 the forward is collective."""
        self.last_eval_step = self.state.step
        lines = []
        if self.data.eval:
            result = self._evaluate()
            if self.metrics:
                self.metrics.write(result)
            lines.append(f"eval at step {result['step']}: loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.2f}")
        if self.eval_prompts:
            completions = self.engine.generate(self.eval_prompts, self.cfg.eval_max_new_tokens)
            samples = [{"prompt": self.tokenizer.decode(p, skip_special_tokens=True), "completion": self.tokenizer.decode(c, skip_special_tokens=True)}
                       for p, c in zip(self.eval_prompts, completions)]
            if self.metrics:
                self.metrics.write({"step": self.state.step, "samples": samples})
            lines.append(f"sample at step {self.state.step}: {samples[0]['prompt'][-60:]!r} -> {samples[0]['completion'][:120]!r}")
        for line in lines if self.metrics else []:
            self.progress.write(line) if self.progress else log.info("%s", line)

    def save(self) -> None:
        if (self.data.eval or self.eval_prompts) and self.last_eval_step != self.state.step:  # the loop may have just evaluated this step
            self._write_eval()
        self.save_checkpoint()  # a final checkpoint lets a later --resume extend the run
        adapter = self.engine.adapter_state()
        if not dist.is_main():
            return
        try:
            save_adapter(self.model.peft_model, self.output_dir, adapter)
        except OSError as e:
            raise TrainingStopped(f"could not write the final adapter to {self.output_dir} ({e.strerror or e}); checkpoint-{self.state.step} holds it. Free space and rerun with --resume", 1, "error") from None
        self.tokenizer.save_pretrained(str(self.output_dir))
        log.info("adapter written to %s", self.output_dir)

    def cleanup(self) -> None:
        metrics = getattr(self, "metrics", None)
        if metrics:
            metrics.close()
        lock = getattr(self, "lock", None)
        if lock:
            lock.release()


def run(cfg: TrainConfig, on_metrics=None) -> None:
    """setup -> train -> save -> cleanup. `on_metrics`: called with each metrics record (rank 0)."""
    recipe = Recipe(cfg, on_metrics)
    try:
        recipe.setup()
        recipe.train()
        recipe.save()
    finally:
        recipe.cleanup()
