"""The engine registry: the matrix, the refusals, `plan` and --help are generated from the backends'
own declarations, so a backend registered from outside (here: a toy one) appears in all of them
without touching another file."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lora_tune.cli import build_parser, config_from_args
from lora_tune.config import PlanConfig, TrainConfig
from lora_tune.engines import registry as engines
from lora_tune.engines import single
from lora_tune.engines.registry import Cell, check_compatibility, supported_cells
from lora_tune.engines.spec import Placement, share
from lora_tune.options import build_config

from helpers import ROOT, fast_train_args, run_cli, single_error_line


def toy_refusal(precision: str, stage: int, offload: str) -> str | None:
    if precision != "bf16":
        return "the toy backend computes in bf16 only; use --precision bf16"
    return "the toy backend keeps everything on the device; use --offload none" if offload != "none" else None


# The one-device backend's engine and loading, declared as another backend from outside the package.
TOY = replace(
    single.SPEC,
    name="toy",
    description="a test backend that splits only the optimizer states",
    multi_process=True,
    default=False,
    refusal=toy_refusal,
    label=lambda stage: "Toy",
    flags=lambda stage: ("--backend", "toy"),
    place=lambda states, stage, offload, world: Placement(share(states, world, optimizer=True)),
    slowdown=lambda stage, offload: 0.5,  # faster than anything: --auto must pick it
    compiles=lambda stage: False,
)


@pytest.fixture
def toy():
    engines.register(TOY)
    yield TOY
    engines.unregister(TOY.name)


def test_a_registered_backend_appears_in_the_matrix(toy):
    matrix = engines.matrix_markdown()
    assert "| Toy | no (" in matrix and "| ✓ | no (" in matrix.split("| Toy |")[1].splitlines()[0]
    assert "the toy backend computes in bf16 only; use --precision bf16" in matrix
    assert "- Toy + CPU offload: the toy backend computes in bf16 only" in matrix  # refused for every precision
    assert Cell("toy", "bf16", 0, "none") in supported_cells()


def test_a_registered_backend_is_planned_by_its_own_placement(toy, capsys):
    def per_device(*argv):
        code, out, err = run_cli(["plan", "--base", "llama-8b", "--precision", "bf16", "--json", *argv], capsys)
        assert code == 0, err
        return json.loads(out)["per_device"]

    one, split = per_device(), per_device("--backend", "toy", "--gpus", "4")
    assert split["optimizer_bytes"] == pytest.approx(one["optimizer_bytes"] / 4, abs=1)
    assert split["weights_bytes"] == one["weights_bytes"] and split["gradients_bytes"] == one["gradients_bytes"]


def test_plan_auto_searches_a_registered_backend_and_train_accepts_its_command(toy, capsys):
    code, out, err = run_cli([*"plan --base llama-8b --auto --gpus 4 --gpu-memory a100-80 --json".split()], capsys)
    assert code == 0, err
    command = json.loads(out)["recommended"]["command"]
    assert "--backend toy" in command and "--precision bf16" in command and "--nproc 4" in command
    words = command.replace("FILE", "data.jsonl").replace("DIR", "out").split()
    cfg = config_from_args(TrainConfig, build_parser().parse_args(words[1:]))
    check_compatibility(cfg, paths=False)


def test_a_registered_backend_is_a_choice_in_help_and_refuses_its_own_cells(toy, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--backend single|ddp|deepspeed|fsdp|toy" in text and "toy: a test backend that splits only the optimizer states" in text
    cfg = build_config(PlanConfig, {}, {"base": "llama-8b", "backend": "toy", "precision": "fp32"})
    with pytest.raises(Exception, match="--precision fp32 with --backend toy: the toy backend computes in bf16 only"):
        check_compatibility(cfg, paths=False)


def test_ddp_is_planned_with_every_state_whole_on_each_rank(capsys):
    """`plan --gpus 4` with no backend plans DDP: each GPU holds what one device holds."""

    def plan(*argv):
        code, out, err = run_cli(["plan", "--base", "llama-8b", "--precision", "bf16", "--json", *argv], capsys)
        assert code == 0, err
        return json.loads(out)["per_device"]

    one, ddp = plan(), plan("--gpus", "4")
    assert ddp == one and ddp["optimizer_bytes"] > 0
    assert plan("--gpus", "4", "--zero", "1")["optimizer_bytes"] == pytest.approx(one["optimizer_bytes"] / 4, abs=1)
    code, out, err = run_cli(["plan", "--base", "llama-8b", "--precision", "bf16", "--gpus", "4"], capsys)
    assert code == 0 and ", DDP, offload none, 4 GPU(s) x 1 node(s)" in out, err


def test_the_builtin_matrix_refuses_what_it_does_not_run():
    cells = set(supported_cells())
    assert Cell("deepspeed", "fp16", 2, "none") not in cells
    assert Cell("fsdp", "fp16", 0, "none") not in cells
    assert not any(c.offload == "nvme" for c in cells)
    assert {
        Cell("deepspeed", "4bit", 3, "cpu"),
        Cell("deepspeed", "4bit", 2, "none"),
        Cell("deepspeed", "8bit", 2, "cpu"),
        Cell("deepspeed", "bf16", 3, "cpu"),
        Cell("deepspeed", "bf16", 1, "none"),
        Cell("fsdp", "4bit", 0, "cpu"),
        Cell("deepspeed", "8bit", 3, "none"),
        Cell("deepspeed", "8bit", 3, "cpu"),
        Cell("fsdp", "8bit", 0, "cpu"),
    } <= cells
    assert Cell("single", "bf16", 0, "cpu").refusal() is not None
    assert {Cell("ddp", precision, 0, "none") for precision in ("fp32", "bf16", "fp16", "8bit", "4bit")} <= cells
    assert not any(c.backend == "ddp" and c.offload != "none" for c in cells)


def test_zero_alone_selects_the_backend_that_runs_that_stage():
    assert engines.backend_name(build_config(PlanConfig, {}, {"base": "b", "zero": 2})) == "deepspeed"
    assert engines.backend_name(build_config(PlanConfig, {}, {"base": "b"})) == "single"
    assert engines.backend_name(build_config(PlanConfig, {}, {"base": "b", "backend": "fsdp"})) == "fsdp"


@pytest.mark.parametrize("several", [dict(nproc=2), dict(gpus=8), dict(nodes=2, gpus=1)])
def test_several_processes_without_a_backend_run_ddp(several):
    """DDP is the default whenever several processes run and neither --backend nor --zero names one;
    --zero and --backend still choose."""
    assert engines.backend_name(build_config(PlanConfig, {}, {"base": "b", **several})) == "ddp"
    assert engines.backend_name(build_config(PlanConfig, {}, {"base": "b", "zero": 1, **several})) == "deepspeed"
    assert engines.backend_name(build_config(PlanConfig, {}, {"base": "b", "backend": "fsdp", **several})) == "fsdp"
    with pytest.raises(Exception, match="several processes need a backend that coordinates them"):
        check_compatibility(build_config(PlanConfig, {}, {"base": "b", "backend": "single", **several}), paths=False)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (dict(offload="cpu"), "--offload needs a sharding backend"),
        (dict(zero=3, offload="nvme"), "can't checkpoint and resume"),
        (dict(zero=2, precision="fp16"), "loss scaler"),
        (dict(zero=3, zero_config="/no/such.json"), "--zero-config: /no/such.json does not exist"),
        (dict(backend="fsdp", precision="fp16"), "loss scaler"),
        (dict(backend="fsdp", offload="nvme"), "host memory only"),
        (dict(backend="fsdp", zero=3), "--zero 3 is not a stage of --backend fsdp; use --backend deepspeed"),
        (
            dict(backend="fsdp", zero_config=str(ROOT / "configs" / "deepspeed" / "zero2.json")),
            "--zero-config belongs to --backend deepspeed",
        ),
        (dict(backend="ddp", offload="cpu"), "DDP keeps every state whole on each rank's device; to offload, shard them"),
        (dict(nproc=2, backend="single"), "several processes need a backend that coordinates them: use --backend ddp"),
    ],
)
def test_refused_cells_of_the_compatibility_matrix(overrides, expected, tiny_model, data_files, tmp_path, capsys):
    code, _, err = run_cli(fast_train_args(tiny_model, data_files["text"], tmp_path / "out", **overrides), capsys)
    assert code == 2 and expected in single_error_line(err)
    assert not (tmp_path / "out").exists()


def test_the_matrix_page_is_the_one_the_engines_declare():
    assert engines.matrix_markdown() in (ROOT / "docs" / "reference" / "matrix.md").read_text()
