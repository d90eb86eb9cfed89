"""The peak of live CPU tensor bytes of a Python module run as a command: on a CPU, the counterpart
of CUDA's `max_memory_allocated`, which the plan's per-device figures count (process RSS also holds
the interpreter, the libraries and the allocator's cached pages). See `lora_tune.planner.measured`.

    python benchmarks/tensor_peak.py OUT.json -m lora_tune train ...

Runs the module as `python -m` would, under the measurement (from before anything is loaded, so the
weights count), and writes {"peak_bytes", "allocations", "exit_code"} to OUT.json. Steps run slower
under the profiler: time them in a separate run.
"""

from __future__ import annotations

import json
import runpy
import sys

from lora_tune.planner.measured import cpu_tensor_peak


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit("usage: python benchmarks/tensor_peak.py OUT.json -m MODULE [ARGS ...]")
    out, module, args = sys.argv[1], sys.argv[3], sys.argv[4:]
    sys.argv = [module, *args]
    code = 0
    with cpu_tensor_peak() as peak:
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    with open(out, "w") as f:
        json.dump({"peak_bytes": peak.bytes, "allocations": peak.allocations, "exit_code": code}, f)
    sys.exit(code)


if __name__ == "__main__":
    main()
