"""OFT: an orthogonal rotation of each weight's input, in blocks (peft's OFTConfig); --rank is the block size."""

from peft import OFTConfig
from peft.tuners.oft.layer import OFTLayer, OFTRotationModule

from lora_tune.models.adapter_types.base import AdapterType


def index_buffers(peft_model) -> None:
    """Each rotation's index buffers (the upper triangle's rows and columns, which only its block size
    decides) rebuilt where peft left them on the meta device (FSDP2 streams the base in: peft moves
    each rotation there with its meta layer), from a rotation module peft builds alike on the CPU."""
    for layer in peft_model.modules():
        if not isinstance(layer, OFTLayer):
            continue
        for rotation in layer.oft_R.values():
            fresh = OFTRotationModule(rotation.r, rotation.n_elements, rotation.block_size, rotation.in_features)
            for name, buffer in fresh.named_buffers(recurse=False):
                setattr(rotation, name, buffer)


TYPE = AdapterType(
    "oft",
    lambda cfg, modules, model_type: OFTConfig(r=0, oft_block_size=cfg.rank, module_dropout=cfg.dropout, target_modules=modules),
    {"rank": "oft_block_size", "alpha": None, "dropout": "module_dropout"},
    reset=lambda layer: layer.reset_oft_parameters("default", True),
    fixed=index_buffers,
)
