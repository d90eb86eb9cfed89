"""HRA: a chain of r Householder reflections of each weight (peft's HRAConfig)."""

from peft import HRAConfig

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "hra",
    lambda cfg, modules, model_type: HRAConfig(r=cfg.rank, target_modules=modules),
    {"rank": "r", "alpha": None, "dropout": None},
    reset=lambda layer: layer.reset_hra_parameters("default"),
)
