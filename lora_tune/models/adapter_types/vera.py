"""VeRA: frozen random A, B shared by every layer, trained scaling vectors (peft's VeraConfig); the
projections are saved with the adapter (save_projection), so it loads anywhere."""

import torch
from peft import VeraConfig
from peft.tuners.vera.model import _kaiming_init

from lora_tune.models.adapter_types.base import AdapterType


def draw_projections(peft_model) -> None:
    """The shared projections drawn again where peft left them on the meta device (FSDP2 streams the
    base in: peft moves them there with the first meta layer they go into, before any layer is filled).
    peft draws them from its own fixed key (projection_prng_key), A then B, from one generator, so every
    rank and backend has the same; drawn here in that order at the shapes peft gave them (its
    `_init_vera_A_vera_B` can't run again once the layers are replaced). The FSDP2 test equals one
    process's run bit for bit."""
    vera = peft_model.base_model
    generator = torch.Generator(device="cpu").manual_seed(vera.peft_config["default"].projection_prng_key)
    for table in (vera.vera_A, vera.vera_B):  # the tables every layer holds
        table["default"] = _kaiming_init(tuple(table["default"].shape), generator=generator)


TYPE = AdapterType(
    "vera",
    lambda cfg, modules, model_type: VeraConfig(r=cfg.rank, vera_dropout=cfg.dropout, target_modules=modules, save_projection=True),
    {"rank": "r", "alpha": None, "dropout": "vera_dropout"},
    reset=lambda layer: layer.reset_vera_parameters("default"),
    fixed=draw_projections,
)
