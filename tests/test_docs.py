"""The documentation site: its generated pages are current, it builds with `mkdocs build --strict`
(broken links and anchors fail), and what its pages show runs: every `lora-tune ...` command parses
with the real parser (only flags that exist), every YAML block is a valid config, every Python block
compiles. The README is a front page of at most 250 lines whose links land (its Quick start is run
by tests/test_presets_and_readme.py)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from markdown.extensions.toc import slugify

from lora_tune.cli import build_parser
from lora_tune.config import TrainConfig
from lora_tune.options import build_config

from helpers import ROOT

spec = importlib.util.spec_from_file_location("gen_pages", ROOT / "docs" / "gen_pages.py")
gen_pages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_pages)

PAGES = sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(kind: str) -> list[tuple[str, str]]:
    """(page, code) of every fenced block of this language in the docs and the README."""
    found = []
    for path in [*PAGES, ROOT / "README.md"]:
        for lang, code in FENCE.findall(path.read_text()):
            if lang == kind:
                found.append((path.relative_to(ROOT).as_posix(), code))
    return found


@pytest.mark.parametrize("page", list(gen_pages.PAGES))
def test_generated_pages_are_current(page):
    on_disk = (ROOT / "docs" / page).read_text()
    assert on_disk == gen_pages.NOTE + gen_pages.PAGES[page](), f"docs/{page} is stale: run python docs/gen_pages.py"


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def commands() -> list[tuple[str, list[str]]]:
    """Every `lora-tune ...` (or `-m lora_tune ...`) command in a bash block, continuation lines joined,
    comments and pipes cut, as argv after the program."""
    found = []
    for page, code in blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].split(" | ")[0].split(" && ")[-1].strip()
            for program in ("lora-tune ", "-m lora_tune "):
                if program in line and not line.startswith("#"):
                    argv = shlex.split(line.split(program, 1)[1])
                    found.append((page, [a for a in argv if a != "..."]))  # `...`: the options shown elsewhere
    return found


def test_every_command_in_the_docs_parses_with_the_real_parser():
    parser = build_parser()
    shown = commands()
    assert len(shown) >= 30  # the pages do show commands
    for page, argv in shown:
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            if argv[-1:] == ["--help"] and e.code == 0:
                continue
            pytest.fail(f"{page}: `lora-tune {shlex.join(argv)}` does not parse")


def test_every_yaml_block_is_a_valid_config():
    shown = blocks("yaml")
    assert shown
    for page, code in shown:
        values = yaml.safe_load(code)
        if not isinstance(values, dict) or {"zero_optimization", "services"} & set(values):
            continue  # a DeepSpeed JSON-as-YAML or another tool's file
        required = {"base": "b", "data": "d.jsonl", "output_dir": "o"}
        build_config(TrainConfig, {**required, **values}, {}, source=page)  # an unknown key or a bad value raises


def test_every_python_block_compiles():
    shown = blocks("python")
    assert shown
    for page, code in shown:
        compile(code, page, "exec")


def anchors(page) -> set[str]:
    """The heading anchors MkDocs gives a page (Python-Markdown's toc slugify)."""
    text = FENCE.sub("", page.read_text())
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_a_front_page_whose_links_land():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    pages = {link.split("#")[0] for link in links if not link.startswith("http")}
    # One click to each task's page, from the table of what it does and from "where to go next".
    for page in (
        "install",
        "quickstart",
        "data",
        "training",
        "preference",
        "grpo",
        "image-text",
        "long-context",
        "distributed",
        "memory",
        "after-training",
        "api",
        "performance",
        "troubleshooting",
        "reference/cli",
    ):
        assert f"docs/{page}.md" in pages, page
    for link in links:
        if link.startswith("http"):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(target), f"README links to {link}: {path} has no heading with that anchor"
