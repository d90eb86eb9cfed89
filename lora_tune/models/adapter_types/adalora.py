"""AdaLoRA: LoRA whose rank budget is reallocated during training (peft's AdaLoraConfig). Refused for
now: its allocator (update_and_allocate) must run between each optimizer step and zeroing the
gradients, and its orthogonality penalty is added to the loss peft's forward returns, which the
chunked loss never asks for; trained without them it would be plain SVD-LoRA, not AdaLoRA."""

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "adalora",
    lambda cfg, modules, model_type: None,
    {"rank": "init_r", "alpha": "lora_alpha", "dropout": "lora_dropout"},
    refusal="AdaLoRA's rank allocator (peft's update_and_allocate) has to run between every optimizer step and zeroing the "
    "gradients, and its orthogonality penalty rides on the loss peft's forward returns, which the chunked loss never asks "
    "for; without them it is not AdaLoRA. Use --peft-type lora (or loha, lokr)",
)
