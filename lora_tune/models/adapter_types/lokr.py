"""LoKr: the update as a Kronecker product with a low-rank factor (peft's LoKrConfig)."""

from peft import LoKrConfig

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "lokr",
    lambda cfg, modules, model_type: LoKrConfig(r=cfg.rank, alpha=cfg.lora_alpha, module_dropout=cfg.dropout, target_modules=modules),
    {"rank": "r", "alpha": "alpha", "dropout": "module_dropout"},
    reset=lambda layer: layer.reset_adapter_parameters("default"),
)
