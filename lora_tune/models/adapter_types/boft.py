"""BOFT: orthogonal rotations factored as butterflies (peft's BOFTConfig); --rank is the block size."""

from peft import BOFTConfig

from lora_tune.models.adapter_types.base import AdapterType


def planned(n_in: int, n_out: int, cfg) -> tuple[list[int], int]:
    """One adapted linear as peft builds it with one butterfly factor (a test checks it against peft's
    build): the rotation blocks (n_in / b blocks of b x b) and the output scale (n_out) trained, and a
    fixed fp32 permutation matrix of the input, n_in x n_in, kept beside them on every rank (no backend
    shards buffers): 64 MiB for a 4,096-wide input, most of a BOFT run's memory on a 7B base. peft computes
    the permutations on real values, so it can't build BOFT on the planner's meta skeleton."""
    return [n_in * cfg.rank, n_out], 4 * n_in * n_in


TYPE = AdapterType(
    "boft",
    lambda cfg, modules, model_type: BOFTConfig(
        boft_block_size=cfg.rank, boft_block_num=0, boft_n_butterfly_factor=1, boft_dropout=cfg.dropout, target_modules=modules
    ),
    {"rank": "boft_block_size", "alpha": None, "dropout": "boft_dropout"},
    reset=lambda layer: layer.reset_boft_parameters("default", True),
    planned=planned,
)
