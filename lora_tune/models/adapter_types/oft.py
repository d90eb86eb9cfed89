"""OFT: an orthogonal rotation of each weight's input, in blocks (peft's OFTConfig); --rank is the block size."""

from peft import OFTConfig

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "oft",
    lambda cfg, modules, model_type: OFTConfig(r=0, oft_block_size=cfg.rank, module_dropout=cfg.dropout, target_modules=modules),
    {"rank": "oft_block_size", "alpha": None, "dropout": "module_dropout"},
)
