"""LoRA (peft's LoraConfig, lora_tune.models.targets.lora_config): the default, and the only type
with inits, DoRA, rsLoRA, LoRA+ and patterns."""

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType("lora", None, {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout"}, quantized=True)
