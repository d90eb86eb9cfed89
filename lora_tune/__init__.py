"""lora-tune: LoRA fine-tuning of large language models on the GPUs people have."""

__version__ = "0.1.0"
