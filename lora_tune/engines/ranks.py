"""What every multi-process run shares, whatever the backend: rank helpers and agreement between
ranks (the `--nproc` launcher is `lora_tune.training.launcher`).

One rule holds throughout: rank 0 writes files and prints progress; every rank takes part in
the collectives (gathering LoRA weights, barriers), so none waits for another forever.
"""

from __future__ import annotations

import os

import torch

from lora_tune.models.sequence_parallel import SequenceGroup


# --- ranks ---------------------------------------------------------------------------------------
def rank() -> int:
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def processes(cfg) -> tuple[int, int]:
    """(processes per node, nodes) a configuration runs with: `plan`'s --gpus and --nodes, else
    --nproc (one node), else the launcher's world (torchrun's local and total sizes; one process
    when not launched)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    per_node = getattr(cfg, "gpus", None) or cfg.nproc or local
    return per_node, getattr(cfg, "nodes", None) or max(1, world_size() // local)


def is_main() -> bool:
    return rank() == 0


def launched() -> bool:
    """True inside torchrun / deepspeed / accelerate launch (they all set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def join(device: torch.device) -> None:
    """This process into the job's process group (once), on the backend that reduces this device's
    tensors: NCCL for a GPU, gloo for a CPU."""
    if torch.distributed.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _on_collective_device(t: torch.Tensor) -> torch.Tensor:
    """NCCL reduces GPU tensors only; gloo CPU ones. The small tensors of these helpers go where the
    process group's backend can reduce them."""
    if torch.distributed.get_backend() == "nccl":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def any_rank(flag: bool) -> bool:
    """True if the flag is set on any rank: used so that all ranks stop at the same step."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    t = _on_collective_device(torch.tensor([1 if flag else 0]))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def all_sum(value: float) -> float:
    """The sum of a number over all ranks (the number itself on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = _on_collective_device(torch.tensor([value], dtype=torch.float64))
    torch.distributed.all_reduce(t)
    return float(t[0])


def all_sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of a (CPU) tensor over all ranks, on every rank (the tensor itself on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return t
    out = _on_collective_device(t.to(torch.float64).clone())
    torch.distributed.all_reduce(out)
    return out.to(device=t.device, dtype=t.dtype)


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of a (CPU) tensor, the same shape on each, concatenated in rank order (the
    tensor itself on one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return t
    local = _on_collective_device(t.contiguous())
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, local)
    return torch.cat(parts).to(t.device)


def first_message(message: str | None) -> str | None:
    """The lowest rank's message among the ranks that have one, on every rank (None when none has):
    so that a failure on one rank stops every rank with the same line, and none waits for it."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return message
    messages: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, message)
    return next((m for m in messages if m is not None), None)


# --- sequence parallelism ------------------------------------------------------------------------
_SEQUENCE_GROUPS: dict[tuple[int, int], list] = {}  # (world, size) -> the process groups, made once per process


def sequence_group(size: int) -> SequenceGroup | None:
    """This rank's group of `size` consecutive ranks that share every row (--sequence-parallel),
    None without. Every rank creates every group, in the same order, as torch.distributed requires."""
    if size <= 1:
        return None
    world = world_size()
    key = (world, size)
    if key not in _SEQUENCE_GROUPS:
        _SEQUENCE_GROUPS[key] = [torch.distributed.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    return SequenceGroup(_SEQUENCE_GROUPS[key][rank() // size], size, rank() % size)  # fresh buffers per run


def data_parallel(group: SequenceGroup | None) -> tuple[int, int]:
    """(how many data-parallel places, this rank's): ranks of one sequence group train the same rows."""
    size = group.size if group else 1
    return world_size() // size, rank() // size


def release_sequence_groups() -> None:
    """Destroy this process's sequence-parallel groups once a run is done: a gloo group left to the
    interpreter's exit can abort it ("terminate called without an active exception") while its
    threads are torn down."""
    for groups in _SEQUENCE_GROUPS.values():
        for group in groups:
            torch.distributed.destroy_process_group(group)
    _SEQUENCE_GROUPS.clear()
