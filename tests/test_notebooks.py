"""Every notebook runs top to bottom on the tiny model (nbclient), and shows what it promises."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def execute(path: Path, workdir: Path, monkeypatch):
    monkeypatch.setenv("LORA_TUNE_NOTEBOOK_DIR", str(workdir))
    monkeypatch.setenv("LORA_TUNE_CACHE", str(workdir / "cache"))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def text_of(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            out.append(o.get("text", ""))
            out.append(o.get("data", {}).get("text/plain", ""))
            out.append(o.get("data", {}).get("text/html", ""))
    return "".join(out)


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_notebooks_are_stored_without_outputs_and_install_in_colab():
    assert {p.name for p in NOTEBOOKS} == {
        "quickstart.ipynb",
        "plan_70b.ipynb",
        "merge_and_serve.ipynb",
        "preference.ipynb",
        "grpo.ipynb",
        "vision_language.ipynb",
    }
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), path.name
        first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "google.colab" in "".join(first_code["source"]) and "pip" in "".join(first_code["source"])
        assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb["cells"]), f"{path.name} needs a parameter cell"


def test_quickstart(tmp_path, monkeypatch):
    nb = execute(ROOT / "notebooks" / "quickstart.ipynb", tmp_path, monkeypatch)
    text = text_of(nb)
    assert "green: trained" in text and "with a loss" in text  # the samples, masks marked
    assert "fits in" in text  # the plan
    assert "before:" in text and "after:" in text and "merged:" in text
    assert images(nb) >= 1 and (tmp_path / "curves.png").is_file()  # the live plot
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert "eval: base" in text and "gguf: model.gguf" in text and "tokenizer ids equal: True" in text  # eval + export (issue 22)
    assert (tmp_path / "model.gguf").is_file() and (tmp_path / "run" / "eval_results.json").is_file()


def test_plan_70b(tmp_path, monkeypatch):
    nb = execute(ROOT / "notebooks" / "plan_70b.ipynb", tmp_path, monkeypatch)
    text = text_of(nb)
    assert text.count("GiB per GPU") >= 5 and "lora-tune train --base llama-70b" in text
    assert "torchrun --nnodes 2" in text  # the multi-node command
    assert images(nb) >= 1 and (tmp_path / "plan_70b.png").is_file()


def test_merge_and_serve(tmp_path, monkeypatch):
    nb = execute(ROOT / "notebooks" / "merge_and_serve.ipynb", tmp_path, monkeypatch)
    text = text_of(nb)
    assert "verified: drift" in text
    assert "model.safetensors" in text and "config.json" in text and "tokenizer.json" in text
    assert "merged:" in text and "adapter:" in text and "greedy tokens agree" in text


def test_preference(tmp_path, monkeypatch):
    """SFT, then DPO from the SFT adapter: the pairs shown as scored, the plan of two sequences, the
    rule followed by no generation before and by every one after, the merge generating the same."""
    nb = execute(ROOT / "notebooks" / "preference.ipynb", tmp_path, monkeypatch)
    text = text_of(nb)
    assert "chosen:" in text and "rejected:" in text and "green: trained" in text
    assert "x 2 sequences (dpo)" in text and "reference (dpo)" in text
    assert "(0 of 6 follow the rule)" in text and "(6 of 6 follow the rule)" in text
    assert "held-out reward accuracy 1.00" in text and "reference for dpo: one pass over the data" in text
    assert images(nb) >= 1 and (tmp_path / "dpo_curves.png").is_file()
    assert (tmp_path / "merged" / "model.safetensors").is_file() and "merged:" in text


def test_grpo(tmp_path, monkeypatch):
    """GRPO with a reward function given as a Python function: the plan of a rollout, the toy reward
    learned (from about one half to almost all even token ids), the completions file, the report."""
    nb = execute(ROOT / "notebooks" / "grpo.ipynb", tmp_path, monkeypatch)
    text = text_of(nb)
    assert "def correct(" in text and "16 completions per rollout (grpo)" in text and "fits in" in text
    first, last = map(float, re.search(r"mean reward: first 4 steps ([\d.]+), last 4 steps ([\d.]+)", text).groups())
    assert first < 0.7 and last > 0.9, (first, last)
    assert re.search(r"step \d+: reward [\d.]+, advantage [+-][\d.]+: ", text)
    assert "reward: " in text and " -> " in text  # the report's summary line
    assert images(nb) >= 1 and (tmp_path / "grpo_curves.png").is_file() and (tmp_path / "grpo" / "report.png").is_file()


def test_vision_language(tmp_path, monkeypatch):
    """A tiny image-text model trained on drawn pictures through the API: the images shown, the base
    and trained answers, the metrics, the verified merge loaded with AutoProcessor +
    AutoModelForImageTextToText generating what base + adapter generate."""
    nb = execute(ROOT / "notebooks" / "vision_language.ipynb", tmp_path, monkeypatch)
    text = text_of(nb)
    assert "processor_config.json" in text and '"type": "image"' in text
    assert text.count("before: ") == 4 and text.count("after:  ") == 4 and text.count("merged: ") == 4
    first, last = map(float, re.search(r"\d+ steps, loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < first, (first, last)
    assert re.search(r"\d of 4 colours named", text) and "tokens/s" in text
    assert "verified: drift" in text and "merged answers equal base + adapter's: True" in text
    assert images(nb) >= 2 and (tmp_path / "vision_curves.png").is_file()  # the pictures and the live plot
    assert (tmp_path / "merged" / "model.safetensors").is_file() and (tmp_path / "merged" / "processor_config.json").is_file()
