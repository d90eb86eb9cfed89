"""LoHa: the update as a Hadamard product of two low-rank products (peft's LoHaConfig)."""

from peft import LoHaConfig

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "loha",
    lambda cfg, modules, model_type: LoHaConfig(r=cfg.rank, alpha=cfg.lora_alpha, module_dropout=cfg.dropout, target_modules=modules),
    {"rank": "r", "alpha": "alpha", "dropout": "module_dropout"},
    reset=lambda layer: layer.reset_adapter_parameters("default"),
    partitioned_base=False,  # peft's LoHa layer takes its shape from base_layer.weight.shape
)
