"""The rooms' layering (pyproject.toml's import-linter contracts, ARCHITECTURE.md's map) holds for
the package, and each contract fails on a deliberately wrong import in a copy of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import tomllib

from helpers import ROOT

# lint-imports, run by this interpreter (its console script is a click command)
LINT = [
    sys.executable,
    "-c",
    "from importlinter.cli import lint_imports_command; lint_imports_command()",
    "--config",
    str(ROOT / "pyproject.toml"),
]


def lint(package_parent, config=ROOT / "pyproject.toml") -> subprocess.CompletedProcess:
    """lint-imports over the lora_tune found first on PYTHONPATH=package_parent."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    argv = [*LINT[:-1], str(config)]
    return subprocess.run(argv, cwd=package_parent, env=env, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_every_contract(tmp_path):
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Contracts: 3 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    "module,line,broken",
    [
        # the loop printing the planner's table itself (as it did before the rooms)
        ("training/loop.py", "from lora_tune.planner import render", "training never imports what comes after it, nor the planner"),
        # the data room asking the objectives' registry (as prepare.py did)
        ("data/prepare.py", "from lora_tune.training.objectives import registry", "rooms are layered by the data flow"),
        # two modules of a room importing each other
        ("models/structure.py", "from lora_tune.models import targets", "no import cycles between the modules and packages of a room"),
    ],
)
def test_a_wrong_import_breaks_its_contract(module, line, broken, tmp_path):
    shutil.copytree(ROOT / "lora_tune", tmp_path / "lora_tune", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "lora_tune" / module
    source = path.read_text()
    at = source.index("from __future__ import annotations\n") + len("from __future__ import annotations\n")
    path.write_text(source[:at] + line + "  # noqa\n" + source[at:])
    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"{broken} BROKEN" in result.stdout


def test_no_room_has_an_import_cycle_even_through_type_hints(tmp_path):
    """The contracts leave imports under `if TYPE_CHECKING:` out (a room naming TrainConfig in a
    signature is no dependency), but modules of one room that name each other's records are a
    cycle either way (the planner's memory <-> vision was one, hidden under TYPE_CHECKING): the
    acyclic contract also holds with them counted."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    acyclic = next(c for c in contracts if c["type"] == "acyclic_siblings")
    ancestors = ", ".join(f'"{a}"' for a in acyclic["ancestors"])
    config = tmp_path / "type-hints-count.toml"
    config.write_text(
        '[tool.importlinter]\nroot_package = "lora_tune"\nexclude_type_checking_imports = false\n\n'
        f'[[tool.importlinter.contracts]]\nname = "{acyclic["name"]}"\ntype = "acyclic_siblings"\nancestors = [{ancestors}]\n'
    )
    result = lint(ROOT, config)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"{acyclic['name']} KEPT" in result.stdout
