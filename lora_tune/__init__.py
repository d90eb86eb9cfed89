"""lora-tune: LoRA fine-tuning of large language models on the GPUs people have.

The Python API mirrors the CLI: `train`, `plan`, `merge`, `report`, `load`, `evaluate`, `export`,
`check_serving` (see `lora_tune.api`). Importing the package stays cheap: torch and friends load
when a function is first called."""

from lora_tune.errors import UserError

__version__ = "0.1.0"
__all__ = ["train", "plan", "merge", "load", "report", "evaluate", "export", "check_serving", "UserError", "TrainResult", "__version__"]


def __getattr__(name: str):
    if name in ("train", "plan", "merge", "load", "report", "evaluate", "export", "check_serving", "TrainResult"):
        from lora_tune import api  # noqa: PLC0415 - start-up time: `import lora_tune` stays light until a function is used

        return getattr(api, name)
    raise AttributeError(f"module 'lora_tune' has no attribute {name!r}")
