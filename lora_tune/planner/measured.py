"""What the plan's per-device figures are checked against, measured: on CUDA the allocator's
`max_memory_allocated`; on a CPU, which has no such counter, the peak of live tensor bytes replayed
from PyTorch's profiler, whose `profile_memory` records every allocation and free made through
PyTorch's CPU allocator with its size. Process RSS is not the counterpart: it also holds the
interpreter, the libraries and the allocator's cached pages, which the plan does not count.

Used by the planner's tests and `benchmarks/tensor_peak.py`; the profiler slows what it watches, so
time things in a separate run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


@dataclass
class TensorPeak:
    bytes: int = 0  # the highest total of live CPU tensor bytes allocated inside the block
    allocations: int = 0  # allocation and free events seen


@contextmanager
def cpu_tensor_peak() -> Iterator[TensorPeak]:
    """Measure the block: `with cpu_tensor_peak() as peak: ...`, then `peak.bytes`. Counts from what
    was live when the block began (tensors made before it, the weights of a model already loaded,
    are not in the figure; frees of them are not seen either)."""
    result = TensorPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    changes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            changes.append((event.start_time_ns, event.extra_fields.alloc_size))  # a free is a negative size
        stack.extend(event.children)
    live = 0
    for _, size in sorted(changes):
        live += size
        result.bytes = max(result.bytes, live)
    result.allocations = len(changes)
