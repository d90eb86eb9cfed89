"""Run a list of `lora-tune` commands one after another inside one multi-process job.

Started by `run_jobs` (tests/conftest.py) as `python -m torch.distributed.run --nproc_per_node 2
tests/distributed_jobs.py JOBS.json`: every rank calls the real CLI entry point (`lora_tune.cli.main`)
with each job's argv, so a whole matrix of distributed runs pays for one process start-up and one
process group instead of one per cell. Each job's stderr goes to its own file per rank, and its
exit code (or the exception it raised) to RESULTS.json. A job {"copy": [src, dst]} copies a
checkpoint folder on rank 0 (to set up a resume from it).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import traceback

import torch

from lora_tune.cli import main as cli_main


def main(jobs_file: str) -> None:

    rank = int(os.environ["RANK"])
    jobs = json.loads(open(jobs_file).read())
    results = []
    for i, job in enumerate(jobs):
        if "copy" in job:
            src, dst = job["copy"]
            if rank == 0:
                os.makedirs(dst, exist_ok=True)
                shutil.copytree(src, os.path.join(dst, os.path.basename(src)))
                for name in job.get("files", []):
                    shutil.copy(os.path.join(os.path.dirname(src), name), dst)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            results.append({"code": 0})
            continue
        with open(f"{job['stderr']}.rank{rank}", "w") as err, contextlib.redirect_stderr(err):
            try:
                code = cli_main([str(a) for a in job["argv"]])
                results.append({"code": code})
            except BaseException:  # noqa: BLE001 - recorded for the test to show
                traceback.print_exc()
                results.append({"code": "exception", "job": i})
        gc.collect()  # drop the finished run's engine (and any ZeRO-3 registration with it)
    if rank == 0:
        with open(jobs_file + ".results", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
