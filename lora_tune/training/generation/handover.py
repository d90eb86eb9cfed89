"""The adapter a vLLM engine generates with, handed over each generation batch: written by rank 0
into OUTPUT_DIR/rollout-adapters/gen-INDEX (peft's layout, which vLLM loads), gathered from the
ranks' shards first (under ZeRO-3 and FSDP2 only the LoRA tensors are gathered, never the base),
whole before vLLM sees it (written under a temporary name, then renamed), and removed once the next
one is in use. Nothing of it outlives the run: the folder is cleared when a run (or resume) starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lora_tune.engines import ranks as dist
from lora_tune.files import remove_tree
from lora_tune.models.adapter import save_adapter

FOLDER = "rollout-adapters"


def folder(output_dir: Path) -> Path:
    return output_dir / FOLDER


def clear(output_dir: Path) -> None:
    """What a run killed mid-batch left (rank 0, before the server is asked for anything)."""
    remove_tree(folder(output_dir))


def remove(path: Path) -> None:
    remove_tree(path)


def probe(adapters: Path) -> Path:
    """An adapter config of rank 512 with no weights (vLLM checks the rank from the config alone)."""
    path = adapters / "rank-probe"
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 512, "lora_alpha": 512, "target_modules": ["q_proj"], "bias": "none", "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


class Handover:
    """`every_rank`: each rank writes its own copy (gen-INDEX-rankR) for an engine of its own (colocated
    vLLM); else rank 0 writes the one a server reads."""

    def __init__(self, adapters: Path, peft_model, engine, every_rank: bool = False):
        self.adapters, self.peft_model, self.engine, self.every_rank = adapters, peft_model, engine, every_rank
        self.previous: Path | None = None
        self.current: Path | None = None

    def writes(self) -> bool:
        return self.every_rank or dist.is_main()

    def publish(self, index: int) -> Path:
        """The adapter as it is now, in gen-INDEX (collective: the engine gathers its shards)."""
        state = self.engine.adapter_state()
        path = self.adapters / (f"gen-{index}-rank{dist.rank()}" if self.every_rank else f"gen-{index}")
        if self.writes():
            tmp = self.adapters / f".{path.name}.tmp-{os.getpid()}"
            remove_tree(tmp)
            save_adapter(self.peft_model, tmp, state)
            remove_tree(path)
            os.replace(tmp, path)
        self.previous, self.current = self.current, path
        return path

    def retire(self) -> None:
        """The batch before the current one is no longer served: its folder goes."""
        if self.previous is not None and self.writes():
            remove_tree(self.previous)
        self.previous = None
