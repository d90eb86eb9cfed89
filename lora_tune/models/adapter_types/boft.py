"""BOFT: orthogonal rotations factored as butterflies (peft's BOFTConfig); --rank is the block size."""

from peft import BOFTConfig

from lora_tune.models.adapter_types.base import AdapterType

TYPE = AdapterType(
    "boft",
    lambda cfg, modules, model_type: BOFTConfig(
        boft_block_size=cfg.rank, boft_block_num=0, boft_n_butterfly_factor=1, boft_dropout=cfg.dropout, target_modules=modules
    ),
    {"rank": "boft_block_size", "alpha": None, "dropout": "boft_dropout"},
)
