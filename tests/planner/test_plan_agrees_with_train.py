"""`plan` and `train` agree: every setup `plan --auto` recommends passes the checks `train` runs before
it loads anything (the backend's cell, --compile's, the objective's options, layer-by-layer loading,
--sequence-parallel), over a grid of flags and families; and a setup `plan` is given explicitly is
refused by `plan` exactly when `train` refuses it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from lora_tune.cli import build_parser, config_from_args
from lora_tune.config import TrainConfig
from lora_tune.engines import registry as engines
from lora_tune.errors import UserError
from lora_tune.models.loading import quant_method
from lora_tune.planner.architecture import load_architecture
from lora_tune.training import compilation
from lora_tune.training.objectives import registry as objectives
from lora_tune.training.run_folder import run_world_size

from families import family_configs
from helpers import run_cli, single_error_line

# Aliases (shipped configs at full size): a dense Llama, a sliding-window family (Gemma 2: sequence
# parallelism refused), a MoE; and tiny families of tests/families.py as local folders.
ALIASES = ("llama-8b", "gemma2-9b", "mixtral-8x7b")
FAMILIES = ("gemma2", "mixtral", "gpt2")
GRID = {
    "one GPU": ["--gpu-memory", "rtx4090"],
    "8 GPUs": ["--gpus", "8", "--gpu-memory", "a100-40"],
    "8 GPUs, long rows": ["--gpus", "8", "--gpu-memory", "80GB", "--max-seq-len", "262144"],
    "8 GPUs, the longest rows": ["--gpus", "8", "--gpu-memory", "80GB", "--max-context"],
    "2 nodes, long rows": ["--gpus", "4", "--nodes", "2", "--gpu-memory", "80GB", "--max-seq-len", "131072"],
    "full logits, long rows": ["--gpus", "8", "--gpu-memory", "80GB", "--max-seq-len", "131072", "--loss-chunk-size", "0"],
    "preference pairs": ["--gpus", "2", "--gpu-memory", "a100-40", "--objective", "dpo"],
    "preference pairs, the longest rows": ["--gpus", "8", "--gpu-memory", "80GB", "--objective", "dpo", "--max-context"],
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Each base's name for --base, and the transformers config train reads of it."""
    root = tmp_path_factory.mktemp("family-configs")
    found = {alias: load_architecture(alias).config for alias in ALIASES}
    configs = family_configs(vocab=512)
    for family in FAMILIES:
        configs[family].save_pretrained(root / family)  # config.json alone: plan and train's checks read no weights
        found[str(root / family)] = configs[family]
    return found


def train_checks(command: str, config) -> TrainConfig:
    """Run what `train` checks before loading on the printed command (its placeholders filled); under
    torchrun, with the job's world as --nproc (what train reads from the launcher's environment)."""
    words = shlex.split(command.replace("FILE", "data.jsonl").replace("DIR", "out"))
    extra = []
    if words[0] == "torchrun":
        nodes, per_node = int(words[words.index("--nnodes") + 1]), int(words[words.index("--nproc-per-node") + 1])
        words, extra = words[words.index("lora_tune") :], ["--nproc", str(nodes * per_node)]
    cfg = config_from_args(TrainConfig, build_parser().parse_args([*words[1:], *extra]))
    engines.check_compatibility(cfg)
    compilation.check_cell(cfg, engines.spec_of(cfg))
    objectives.check_options(cfg)
    engines.check_layer_by_layer(cfg, quant_method(config))
    engines.check_sequence_parallel(cfg, config, run_world_size(cfg))
    return cfg


# What fits nothing on these GPUs: full logits over 131k-token rows (sequence parallelism needs the
# chunked loss), and Mixtral-8x7B's 93 GB of bf16 base whole on each 80 GB GPU (DDP, the default:
# --max-context searches the degrees of the backend it is given, not backends).
NOTHING_FITS = {
    ("llama-8b", "full logits, long rows"),
    ("gemma2-9b", "full logits, long rows"),
    ("mixtral-8x7b", "full logits, long rows"),
    ("mixtral-8x7b", "8 GPUs, the longest rows"),
    ("mixtral-8x7b", "preference pairs, the longest rows"),
}


def test_train_accepts_every_setup_plan_auto_recommends(bases, capsys):
    nothing, split = set(), set()
    for base, config in bases.items():
        for name, flags in GRID.items():
            code, out, err = run_cli(["plan", "--base", base, "--auto", "--json", *flags], capsys)
            assert code == 0, (base, name, err)
            best = json.loads(out)["recommended"]
            if best is None:  # nothing fits: no command to run
                nothing.add((base, name))
                continue
            try:
                cfg = train_checks(best["command"], config)
            except UserError as e:
                raise AssertionError(f"{base}, {name}: train refuses the recommended {best['command']!r}: {e}") from None
            if cfg.sequence_parallel > 1:
                split.add((base, name))
    assert nothing == NOTHING_FITS
    # Long rows over 8 GPUs split rows where the model allows it, and never on the sliding-window family.
    assert {("llama-8b", "8 GPUs, long rows"), ("llama-8b", "8 GPUs, the longest rows"), ("llama-8b", "2 nodes, long rows")} <= split
    assert not any(base == "gemma2-9b" or "gemma2" in Path(base).name for base, _ in split)


def test_plan_auto_offers_sequence_parallel_only_where_the_model_takes_it(capsys):
    """Gemma 2 soft-caps its attention and alternates sliding-window layers, which sequence-parallel attention doesn't reproduce:
    the longest rows over 8 GPUs are planned whole on each rank (the heads alone would allow 8)."""
    longest = ["--auto", "--max-context", "--gpus", "8", "--gpu-memory", "80GB", "--json"]
    for base, degree in (("gemma2-9b", 1), ("llama-8b", 8)):
        code, out, err = run_cli(["plan", "--base", base, *longest], capsys)
        assert code == 0, err
        assert json.loads(out)["recommended"]["sequence_parallel"] == degree, base


def test_an_explicit_setup_is_planned_as_train_runs_it(bases, capsys):
    """`plan --gpus 8 --sequence-parallel 8` with no backend is the DDP setup train runs with
    `--nproc 8 --sequence-parallel 8` (one device could never run it); where train refuses the
    setup (a sliding-window family), plan refuses it with train's line."""
    argv = ["--gpus", "8", "--sequence-parallel", "8", "--max-seq-len", "65536", "--gpu-memory", "80GB"]
    code, out, err = run_cli(["plan", "--base", "llama-8b", *argv], capsys)
    assert code == 0, err
    assert "DDP" in out and "one device" not in out
    train_checks("lora-tune train --base llama-8b --data d.jsonl --output-dir out --nproc 8 --sequence-parallel 8", bases["llama-8b"])
    code, _, err = run_cli(["plan", "--base", "gemma2-9b", *argv], capsys)
    line = single_error_line(err)
    assert code == 2 and "--sequence-parallel 8: gemma2 shapes its attention (" in line
    with pytest.raises(UserError, match=r"--sequence-parallel 8: gemma2 shapes its attention \("):
        train_checks("lora-tune train --base gemma2-9b --data d.jsonl --output-dir out --nproc 8 --sequence-parallel 8", bases["gemma2-9b"])
