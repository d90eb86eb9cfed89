"""MiSS (formerly Bone): a shared block of the weight's rows trained (peft's MissConfig); --rank is its r."""

from peft import MissConfig

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "miss",
    lambda cfg, modules, model_type: MissConfig(r=cfg.rank, miss_dropout=cfg.dropout, target_modules=modules),
    {"rank": "r", "alpha": None, "dropout": "miss_dropout"},
    reset=lambda layer: layer.reset_miss_parameters("default", layer.miss_r["default"]),
)
