"""VeRA: frozen random A, B shared by every layer, trained scaling vectors (peft's VeraConfig); the
projections are saved with the adapter (save_projection), so it loads anywhere."""

from peft import VeraConfig

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "vera",
    lambda cfg, modules, model_type: VeraConfig(r=cfg.rank, vera_dropout=cfg.dropout, target_modules=modules, save_projection=True),
    {"rank": "r", "alpha": None, "dropout": "vera_dropout"},
)
