"""IA3: learned scalings of activations (peft's IA3Config): feed-forward outputs are scaled at their
input, as peft's own defaults for the model type say (none named: every target scales its output)."""

from peft import IA3Config
from peft.utils.constants import TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING

from lora_tune.models.adapter_types.base import AdapterType


def build(cfg, modules, model_type):
    feedforward = TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING.get(model_type) or []
    names = modules if isinstance(modules, list) else []
    return IA3Config(target_modules=modules, feedforward_modules=[m for m in feedforward if m in names])


TYPE = AdapterType(
    "ia3", build, {"rank": None, "alpha": None, "dropout": None}, quantized=True, reset=lambda layer: layer.reset_ia3_parameters("default")
)
