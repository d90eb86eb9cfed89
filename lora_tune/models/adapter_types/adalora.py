"""AdaLoRA: LoRA in SVD form (P diag(E) Q per weight) whose rank budget is moved during training to the
weights that matter most (peft's AdaLoraConfig). --rank is each weight's starting rank (init_r); the
budget falls from that to --adalora-target-r on average, on a cubic schedule over the run's steps
(after --adalora-tinit warm-up steps, before --adalora-tfinal final ones), by masking the least
important singular values (peft's RankAllocator).

Two things happen outside the forward, each optimizer step (`RankAllocation`, run by the engines
whose every rank holds every adapter gradient whole: one device, DDP):
- the orthogonality penalty orth_reg_weight x mean ||P^T P - I||_F, ||Q Q^T - I||_F, added to the
  step's objective once. peft adds it to the loss its forward returns, which lora-tune's chunked loss
  never asks for; with one micro-batch per step the gradients are peft's exactly (a test), and with
  several it is still once per step (peft's would count it once per micro-batch);
- peft's own `update_and_allocate` between the optimizer step and zeroing the gradients, which updates
  the importance scores from the gradients and masks E to the step's budget.

The allocator's state (its scores, the step count, the allocated ranks) goes into each rank's
checkpoint part, so a resumed run allocates as the uninterrupted one. The adapter is written whole
(every weight at --rank, the masked singular values zero, no rank_pattern): peft loads, merges and
runs it as is, and a resume takes it back unchanged (a masked triplet can come back while the budget
moves)."""

from __future__ import annotations

import torch
from peft import AdaLoraConfig

from lora_tune.errors import UserError
from lora_tune.models.adapter_types.base import AdapterType

# peft's own defaults (AdaLoraConfig), which ms-swift's adalora_* options share.
TINIT, TFINAL, DELTA_T, ORTH_REG_WEIGHT = 0, 0, 1, 0.5


def target_rank(cfg) -> int:
    """--adalora-target-r, else peft's ratio of its defaults (8 of 12): two thirds of --rank."""
    return cfg.adalora_target_r or max(1, round(2 * cfg.rank / 3))


def schedule(cfg) -> tuple[int, int, int]:
    """(tinit, tfinal, deltaT) of the run."""
    pick = lambda value, default: default if value is None else value  # noqa: E731 - 0 is a value
    return pick(cfg.adalora_tinit, TINIT), pick(cfg.adalora_tfinal, TFINAL), pick(cfg.adalora_delta_t, DELTA_T)


def build(cfg, modules, model_type):
    tinit, tfinal, delta_t = schedule(cfg)
    return AdaLoraConfig(
        init_r=cfg.rank,
        target_r=target_rank(cfg),
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=modules,
        tinit=tinit,
        tfinal=tfinal,
        deltaT=delta_t,
        orth_reg_weight=ORTH_REG_WEIGHT if cfg.adalora_orth_reg_weight is None else cfg.adalora_orth_reg_weight,
        # The run's length is set once the engine builds its optimizer (RankAllocation, through peft's
        # RankAllocator.set_total_step); this one only lets peft build the layers (and plan size them).
        total_step=tinit + tfinal + 1,
    )


def check_steps(cfg, total_steps: int) -> None:
    """Before loading: the schedule leaves steps for the budget to fall in (peft's own condition)."""
    tinit, tfinal, _ = schedule(cfg)
    if target_rank(cfg) > cfg.rank:
        raise UserError(f"--adalora-target-r {cfg.adalora_target_r} is above --rank {cfg.rank}: AdaLoRA only lowers ranks; pick <= --rank")
    if tinit >= total_steps - tfinal:
        raise UserError(
            f"--adalora-tinit {tinit} + --adalora-tfinal {tfinal} leave none of this run's {total_steps} steps for AdaLoRA to "
            "reallocate ranks in: lower them (or train longer)"
        )


def orthogonality_penalty(peft_model) -> torch.Tensor:
    """peft's AdaLoRA regulariser (AdaLoraModel.forward): orth_reg_weight x the mean over every P (lora_A)
    and Q (lora_B) of the Frobenius distance of its Gram matrix to the identity."""
    distances = []
    for name, p in peft_model.base_model.model.named_parameters():
        if ("lora_A" in name or "lora_B" in name) and "default" in name:
            gram = p @ p.T if "lora_A" in name else p.T @ p
            distances.append(torch.linalg.matrix_norm(gram - torch.eye(*gram.shape, dtype=gram.dtype, device=gram.device)))
    return peft_model.peft_config["default"].orth_reg_weight * torch.stack(distances).mean()


class RankAllocation:
    """AdaLoRA's work around each optimizer step (the module docstring says what and why)."""

    def __init__(self, peft_model, total_steps: int):
        self.peft_model = peft_model
        self.tuner = peft_model.base_model  # peft's AdaLoraModel
        self.config = peft_model.peft_config["default"]
        self.tuner.rankallocator.set_total_step(total_steps)
        self.steps = 0  # optimizer steps taken (peft's global_step of the next one)
        self.rank_pattern = None  # the allocated ranks, once masked (peft keeps them in the config)
        self.params = [p for p in peft_model.parameters() if p.requires_grad]

    def add_penalty_gradients(self) -> None:
        """The penalty's gradients, added to the step's (unscaled, all-reduced) ones: the same on every
        rank, which all hold the same weights, so nothing more to reduce."""
        grads = torch.autograd.grad(orthogonality_penalty(self.peft_model), self.params, allow_unused=True)
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)

    def after_step(self, applied: bool) -> None:
        """peft's update_and_allocate for the step just taken (skipped where the step was: an fp16
        overflow's gradients would poison the scores). peft keeps the allocated ranks in the config,
        where writing the adapter would cut every tensor to them; they are kept here instead."""
        if applied:
            self.config.rank_pattern = self.rank_pattern
            try:
                self.tuner.update_and_allocate(self.steps)
            finally:
                self.rank_pattern, self.config.rank_pattern = self.config.rank_pattern, None
        self.steps += 1

    def state_dict(self) -> dict:
        allocator = self.tuner.rankallocator
        return {
            "steps": self.steps,
            "total_step": self.config.total_step,
            "rank_pattern": self.rank_pattern,
            "ipt": allocator.ipt,
            "exp_avg_ipt": allocator.exp_avg_ipt,
            "exp_avg_unc": allocator.exp_avg_unc,
        }

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's allocator. A run extended past its first length keeps that length's schedule:
        its ranks are final from there on (peft's last phase)."""
        allocator = self.tuner.rankallocator
        self.steps, self.rank_pattern = state["steps"], state["rank_pattern"]
        allocator.set_total_step(state["total_step"])
        device = self.params[0].device
        for name in ("ipt", "exp_avg_ipt", "exp_avg_unc"):
            setattr(allocator, name, {key: t.to(device) for key, t in state[name].items()})


def reset(layer) -> None:
    """peft's init of one layer (E = 0, P and Q ~ N(0, 0.02)). Its ranknum, the constant the update is
    divided by, stays frozen: peft casts it to a bf16/fp16 base's dtype through its ParameterDict, which
    makes a new, trainable Parameter of it, and the optimizer would then train it (and weight-decay it)."""
    layer.reset_lora_parameters("default")
    layer.ranknum["default"].requires_grad_(False)


TYPE = AdapterType(
    "adalora",
    build,
    {"rank": "init_r", "alpha": "lora_alpha", "dropout": "lora_dropout"},
    quantized=True,  # peft's SVDLinear8bitLt / SVDLinear4bit
    reset=reset,
    step_hooks=RankAllocation,
    check_steps=check_steps,
    state_bytes=3 * 4,  # the allocator's ipt, exp_avg_ipt, exp_avg_unc: fp32, one per trained element
    options=("adalora_target_r", "adalora_tinit", "adalora_tfinal", "adalora_delta_t", "adalora_orth_reg_weight"),
)
