"""The LoRA inits that learn from the data (--init-lora-weights eva | corda | lora_ga): one statistics
pass over the run's first micro-batches, on the base before the adapter goes in, by peft's own
functions. What the pass finds is left on each target linear layer, where peft's per-layer init
reads it when lora_tune.models.inits initialises that layer:

- EVA: an incremental SVD of each layer's inputs (peft's get_eva_state_dict), the top r right-singular
  vectors become A; B stays 0, so the base is untouched. peft's rank redistribution (rho > 1) is not
  used: every layer keeps --rank, so checkpoints, merge, plan and resume see the shapes the options say.
- CorDA: each weight decomposed with the covariance of its inputs (peft's preprocess_corda,
  instruction-previewed mode); the base keeps the residual.
- LoRA-GA: A, B from an SVD of each weight's gradient of the run's own loss (peft's preprocess_loraga:
  the target weights' gradients, a full fine-tune's gradient memory for them); the base keeps the residual.

The micro-batches are the run's first ones, in its seeded order, so the pass is the same on every rank
and on a resume (which recomputes the residual base of CorDA / LoRA-GA rather than storing it)."""

from __future__ import annotations

import copy
import logging
import time

import torch
from peft import EvaConfig, LoraGAConfig
from peft.tuners.lora.config import CordaConfig
from peft.tuners.lora.corda import preprocess_corda
from peft.tuners.lora.eva import get_eva_state_dict
from peft.tuners.lora.loraga import preprocess_loraga

from lora_tune.errors import UserError

log = logging.getLogger("lora_tune")

FROM_DATA = ("eva", "corda", "lora_ga")
EVA_FOUND = "lora_tune_eva_components"  # the attribute the pass leaves on a layer for EVA's A


def needs_data(init: str | None) -> bool:
    return init in FROM_DATA


def check_data(init: str | None, training_images: int) -> None:
    """What the run's data can't give its init, said before the model loads."""
    if init == "corda" and training_images:
        raise UserError(
            f"--init-lora-weights corda: peft's covariance hooks read one text sequence at a time, and {training_images} training "
            "rows hold images; use eva or pissa with image-text data"
        )


def _on(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def statistics_pass(base, init: str, lora_config, batches: list[dict]) -> None:
    """Run `init`'s statistics over `batches` (model inputs with labels) on the plain base, leaving
    what each target layer's init needs on it."""
    device = next(p.device for p in base.parameters() if p.device.type != "meta")
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    log.info("--init-lora-weights %s: statistics over the first %d micro-batches (%d tokens) ...", init, len(batches), tokens)
    started = time.perf_counter()
    config = copy.deepcopy(lora_config)
    training = base.training
    base.eval()  # no dropout: the same statistics on every rank and every resume
    if init == "eva":
        config.eva_config = EvaConfig(rho=1.0)  # no redistribution: every layer keeps --rank

        def forward(model, batch):
            with torch.no_grad():
                model(**_on(batch, device))

        found = get_eva_state_dict(base, batches, peft_config=config, forward_fn=forward, show_progress_bar=False)
        for name, components in found.items():
            setattr(base.get_submodule(name), EVA_FOUND, components)
    elif init == "corda":
        config.corda_config = CordaConfig(corda_method="ipm")

        def run_model():  # one sequence at a time, without its padding: peft's hooks take a (tokens, features) input
            with torch.no_grad():
                for batch in batches:
                    for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
                        real = ids[mask.bool()].unsqueeze(0).to(device)
                        base(input_ids=real, attention_mask=torch.ones_like(real))

        preprocess_corda(base, config, run_model=run_model)
    elif init == "lora_ga":
        config.lora_ga_config = LoraGAConfig()

        def train_step():
            for batch in batches:
                base(**_on(batch, device)).loss.backward()

        preprocess_loraga(base, config, train_step=train_step)
    else:
        raise ValueError(f"{init} learns nothing from the data")
    base.train(training)
    log.info("--init-lora-weights %s: statistics done in %.1f s", init, time.perf_counter() - started)


def initialise(layer, init: str) -> None:
    """One LoRA layer's values from what the pass left on its base layer (a layer the pass did not
    reach has nothing there: a bug, said by name)."""
    base_layer = layer.get_base_layer()
    if init == "eva":
        components = getattr(base_layer, EVA_FOUND, None)
        if components is None:
            raise RuntimeError("EVA found no components for a LoRA layer; its inputs were not seen by the statistics pass")
        layer.reset_lora_parameters("default", init_lora_weights=True)  # B = 0: the base's function at step 0
        layer.lora_A["default"].weight.data = components.to(layer.lora_A["default"].weight).contiguous()  # DeepSpeed views it as bytes
        delattr(base_layer, EVA_FOUND)
    elif init == "corda":
        layer.corda_init("default", init)
    elif init == "lora_ga":
        if not hasattr(base_layer, "_peft_loraga_grad"):  # peft would fall back to gaussian silently
            raise RuntimeError("LoRA-GA found no gradient for a LoRA layer; the statistics pass did not reach it")
        layer.lora_ga_init("default", LoraGAConfig())
