"""Every notebook runs top to bottom on the tiny model (nbclient), and shows what it promises."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
VLLM_PYTHON = os.environ.get("LORA_TUNE_VLLM_PYTHON")  # the kernels see it: the GRPO notebook's vLLM cell runs
AT_ONCE = 2  # kernels running together: a kernel spends most of its time importing, on one core
SECONDS = {  # alone, 2 cores
    "agent": 90,
    "preference": 38,
    "quickstart": 30,
    "grpo": 23,
    "plan_70b": 21,
    "vision_language": 20,
    "merge_and_serve": 10,
}


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict:
    """Every notebook run top to bottom in a kernel of its own, AT_ONCE at a time, each with a work
    folder of its own: name -> (the executed notebook, or the error it stopped on; its folder). Each
    kernel computes on one thread (two kernels on two cores, never more threads than cores)."""
    results: dict = {}

    async def run(path: Path, gate: asyncio.Semaphore) -> None:
        workdir = tmp_path_factory.mktemp(path.stem)
        env = {**os.environ, "LORA_TUNE_NOTEBOOK_DIR": str(workdir), "LORA_TUNE_CACHE": str(workdir / "cache"), "OMP_NUM_THREADS": "1"}
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
        async with gate:
            try:
                await client.async_execute(env=env)
                results[path.stem] = (nb, workdir)
            except CellExecutionError as e:
                results[path.stem] = (e, workdir)

    async def run_all() -> None:
        gate = asyncio.Semaphore(AT_ONCE)
        longest_first = sorted(NOTEBOOKS, key=lambda path: -SECONDS.get(path.stem, 60))
        await asyncio.gather(*(run(path, gate) for path in longest_first))

    asyncio.run(run_all())
    return results


def execute(executed: dict, name: str):
    """(the executed notebook, its work folder); a notebook that stopped on an error fails here with it."""
    nb, workdir = executed[name]
    if isinstance(nb, Exception):
        raise nb
    return nb, workdir


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
        "agent.ipynb",
    }
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), path.name
        first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "google.colab" in "".join(first_code["source"]) and "pip" in "".join(first_code["source"])
        assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb["cells"]), f"{path.name} needs a parameter cell"


def test_quickstart(executed):
    nb, workdir = execute(executed, "quickstart")
    text = text_of(nb)
    assert "green: trained" in text and "with a loss" in text  # the samples, masks marked
    assert "fits in" in text  # the plan
    assert "before:" in text and "after:" in text and "merged:" in text
    assert images(nb) >= 1 and (workdir / "curves.png").is_file()  # the live plot
    assert (workdir / "merged" / "model.safetensors").is_file()
    assert "eval: base" in text and "gguf: model.gguf" in text and "tokenizer ids equal: True" in text  # eval + export (issue 22)
    assert (workdir / "model.gguf").is_file() and (workdir / "run" / "eval_results.json").is_file()


def test_plan_70b(executed):
    nb, workdir = execute(executed, "plan_70b")
    text = text_of(nb)
    assert text.count("GiB per GPU") >= 5 and "lora-tune train --base llama-70b" in text
    assert "torchrun --nnodes 2" in text  # the multi-node command
    assert images(nb) >= 1 and (workdir / "plan_70b.png").is_file()


def test_merge_and_serve(executed):
    nb, workdir = execute(executed, "merge_and_serve")
    text = text_of(nb)
    assert "verified: drift" in text
    assert "model.safetensors" in text and "config.json" in text and "tokenizer.json" in text
    assert "merged:" in text and "adapter:" in text and "greedy tokens agree" in text


def test_preference(executed):
    """SFT, then DPO from the SFT adapter: the pairs shown as scored, the plan of two sequences, the
    rule followed by no generation before and by every one after, the merge generating the same."""
    nb, workdir = execute(executed, "preference")
    text = text_of(nb)
    assert "chosen:" in text and "rejected:" in text and "green: trained" in text
    assert "x 2 sequences (dpo)" in text and "reference (dpo)" in text
    assert "(0 of 6 follow the rule)" in text and "(6 of 6 follow the rule)" in text
    assert "held-out reward accuracy 1.00" in text and "reference for dpo: one pass over the data" in text
    assert images(nb) >= 1 and (workdir / "dpo_curves.png").is_file()
    assert (workdir / "merged" / "model.safetensors").is_file() and "merged:" in text


def test_grpo(executed):
    """GRPO with a reward function given as a Python function: the plan of a rollout, the toy reward
    learned (from about one half to almost all even token ids), the completions file, the report."""
    nb, workdir = execute(executed, "grpo")
    text = text_of(nb)
    assert "def correct(" in text and "16 completions per rollout (grpo)" in text and "fits in" in text
    first, last = map(float, re.search(r"mean reward: first 4 steps ([\d.]+), last 4 steps ([\d.]+)", text).groups())
    assert first < 0.7 and last > 0.9, (first, last)
    assert re.search(r"step \d+: reward [\d.]+, advantage [+-][\d.]+: ", text)
    assert "reward: " in text and " -> " in text  # the report's summary line
    assert images(nb) >= 1 and (workdir / "grpo_curves.png").is_file() and (workdir / "grpo" / "report.png").is_file()
    if VLLM_PYTHON:  # the vLLM cell: a server started with the run, the adapter handed over, ratio 1 at fp32
        ratios = [float(x) for x in re.findall(r"vLLM step \d: reward [\d.]+, importance ratio ([\d.]+)", text)]
        assert len(ratios) == 2 and all(abs(x - 1) < 1e-3 for x in ratios), text[-2000:]
    else:
        assert "no vLLM environment: set VLLM_PYTHON" in text


def test_agent(executed):
    """A tiny model that calls a calculator, trained with GRPO on CPU: the plan with tools, the run's
    tool calls, an episode with the tool's result in it, the guessing game."""
    nb, workdir = execute(executed, "agent")
    text = text_of(nb)
    assert "448" in text and "def grounded(" in text and "with tools a later turn decodes 96 more" in text
    first, last = map(float, re.search(r"mean reward: first 4 steps ([\d.]+), last 4 steps ([\d.]+)", text).groups())
    calls = float(re.search(r"tool calls per completion: ([\d.]+)", text).group(1))
    assert calls > 0 and 0 <= first <= 2 and 0 <= last <= 2, text[-2000:]
    assert "<tool_response>" in text and "question: What is" in text
    assert "['higher', 'lower', 'correct'] reward 0.333" in text
    assert (workdir / "agent_curves.png").is_file()


def test_vision_language(executed):
    """A tiny image-text model trained on drawn pictures through the API: the images shown, the base
    and trained answers, the metrics, the verified merge loaded with AutoProcessor +
    AutoModelForImageTextToText generating what base + adapter generate."""
    nb, workdir = execute(executed, "vision_language")
    text = text_of(nb)
    assert "processor_config.json" in text and '"type": "image"' in text
    assert text.count("before: ") == 4 and text.count("after:  ") == 4 and text.count("merged: ") == 4
    first, last = map(float, re.search(r"\d+ steps, loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < first, (first, last)
    assert re.search(r"\d of 4 colours named", text) and "tokens/s" in text
    assert "verified: drift" in text and "merged answers equal base + adapter's: True" in text
    assert images(nb) >= 2 and (workdir / "vision_curves.png").is_file()  # the pictures and the live plot
    assert (workdir / "merged" / "model.safetensors").is_file() and (workdir / "merged" / "processor_config.json").is_file()
