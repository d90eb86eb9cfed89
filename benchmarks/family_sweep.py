"""Every family transformers implements, tried as a new user would: train, merge, plan, pack.

For every model type in transformers' causal-LM and image-text-to-text auto mappings, a tiny random
model is built from its default config (`lora_tune.models.tiny.model.build_tiny_model`: shrink_config keeps
the layer kinds, 64 wide, <= 4 experts; saved from the class real checkpoints are saved from, with
the tiny 512-token tokenizer), then, each model type in a process of its own:

  train    `lora-tune train --precision fp32 --max-steps 2 --rank 4` on a small alpaca file
  merge    `lora-tune merge --dtype fp32`; the merged logits vs base + adapter through stock peft
           (relative drift <= 1e-4), and the merged folder stores the base's own tensor names
  plan     `lora-tune plan --rank 4 --json`: trainable parameters == the adapter's
  packing  a packed row of 3 samples vs each alone, and one sample changed: do the others keep
           bit-identical logits? Packing must be exact wherever lora-tune packs (it logs
           "packing off: ..." where it doesn't)
  loss     where lora-tune uses the chunked loss, the output head over the decoder body must give
           the model's own logits

A row is ✓ when every stage passes, "refused (reason)" when lora-tune declines the model in one
`error:` line (train, before loading, or merge), "fails (stage: first error line)" otherwise, and
"n/a (reason)" when no tiny model of the type can be built or run on text alone.

    python benchmarks/family_sweep.py                    # every model type, one at a time
    python benchmarks/family_sweep.py --fast             # the CI subset (tests/test_family_sweep.py runs it)
    python benchmarks/family_sweep.py --only llama,gemma3
    python benchmarks/family_sweep.py --report-only --workdir DIR   # the table again from saved results

Results: benchmarks/results/family_sweep.md (table, counts, wall time) and family_sweep.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# The CI subset: the dozen most fine-tuned families, then one of each structure the issue names:
# MoE with shared experts, dense first layers and MLA; hybrid linear attention; image-text wrappers
# (one with no causal-LM class at all); Conv1D; a checkpoint stored under other names, transposed (ergo).
FAST = (
    "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "gpt_oss", "llama4_text", "olmo2",
    "deepseek_v3", "qwen3_next", "mistral3", "gpt2", "ergo",
)  # fmt: skip

TIMEOUT = 600  # seconds per model type
ALPACA = [
    {"instruction": f"Add {a} and {a + 1}.", "input": "" if a % 2 else "numbers", "output": f"The answer is {2 * a + 1}."}
    for a in range(12)
]
NOT_TEXT = (
    "pixel_values",
    "flattened_patches",
    "bbox",
    "qformer_input_ids",
    "image_embeds",
    "encoder_outputs",
    "set_default_language",
    "shared_kv_states",
    "required positional argument",
    "image_encoder_embeddings",
)


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


class Timeout(Exception):
    pass


def first_error_line(text: str) -> str:
    """What went wrong: lora-tune's `error:` line, else the last line of a traceback."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1][:300]
    return (lines[-1] if lines else "no output")[:300]


def cli(args: list) -> tuple[int | str, str, str, float]:
    """`lora-tune ARGS` in this process: (exit code or 'crash', stdout, stderr, seconds)."""
    from lora_tune.cli import main

    out, err, t0 = io.StringIO(), io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except Timeout:
            raise
        except BaseException:  # noqa: BLE001 - a crash is a result
            print(traceback.format_exc(), file=err)
            code = "crash"
    return code, out.getvalue(), err.getvalue(), round(time.perf_counter() - t0, 1)


def logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def drift(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def disk_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


def check_family(model_type: str, workdir: Path) -> dict:
    """Every stage for one model type, in this process; the result row (status, reason, stages)."""
    import torch
    from peft import PeftModel

    from lora_tune.models.loading import head_probe, load_config, packing_probe
    from lora_tune.models.structure import auto_class, body_path, text_ids
    from lora_tune.models.tiny.model import build_tiny_model

    row: dict = {"model_type": model_type, "stages": {}}
    stages = row["stages"]
    shutil.rmtree(workdir, ignore_errors=True)
    base, adapter, merged = workdir / "base", workdir / "adapter", workdir / "merged"
    t0 = time.perf_counter()
    try:
        build_tiny_model(model_type, base)
        config = load_config(str(base))
        auto = auto_class(config)
        model = auto.from_pretrained(base, dtype=torch.float32).eval()
        logits(model, text_ids(model, (1, 12), seed=0))  # runs on text alone
    except Timeout:
        raise
    except Exception as e:  # noqa: BLE001 - no tiny text model of this type
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
        row["status"], row["reason"] = "n/a", ("not a text model: " if any(k in message for k in NOT_TEXT) else "no tiny model: ") + message
        return row
    stages["build"] = {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - t0, 1),
    }

    data = workdir / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ALPACA))
    train_args = [
        "train",
        "--base",
        base,
        "--data",
        data,
        "--output-dir",
        adapter,
        "--precision",
        "fp32",
        "--max-steps",
        2,
        "--rank",
        4,
        "--lr",
        0.05,
    ]
    train_args += ["--optim", "adamw", "--max-seq-len", 64, "--micro-batch-size", 2, "--data-cache-dir", workdir / "cache"]
    code, _, log, seconds = cli(train_args)
    stages["train"] = {"code": code, "seconds": seconds, "log": [line for line in log.splitlines() if "off:" in line or "left out" in line]}
    if code != 0:
        refused = code == 2 and "Traceback" not in log
        row["status"], row["reason"] = ("refused" if refused else "fails"), ("" if refused else "train: ") + first_error_line(log)
        return row
    packed = "packing on" in log
    chunked = "loss chunked" in log

    # The adapter as stock peft loads it: its LoRA parameters (a block shared across layers counted once).
    with_adapter = PeftModel.from_pretrained(auto.from_pretrained(base, dtype=torch.float32), adapter).eval()
    adapter_params = sum(p.numel() for n, p in with_adapter.named_parameters() if ".lora_" in n)
    language_model = f"base_model.model.{body_path(model)}."
    outside = sorted(n for n, _ in with_adapter.named_parameters() if ".lora_" in n and not n.startswith(language_model))

    code, _, log, seconds = cli(["merge", "--adapter", adapter, "--output", merged, "--dtype", "fp32"])
    stages["merge"] = {"code": code, "seconds": seconds}
    if code != 0:
        refused = code == 2 and "Traceback" not in log
        row["status"], row["reason"] = ("refused" if refused else "fails"), "merge: " + first_error_line(log)
        return row
    ids = text_ids(model, (2, 24), seed=3)
    want = logits(with_adapter, ids)
    got = logits(auto.from_pretrained(merged, dtype=torch.float32).eval(), ids)
    stages["merge"].update(drift=drift(got, want), same_names=disk_names(base) == disk_names(merged))

    code, out, log, seconds = cli(["plan", "--base", base, "--rank", 4, "--json"])
    plan = json.loads(out)["trainable_parameters"] if code == 0 else None
    stages["plan"] = {"code": code, "seconds": seconds, "trainable": plan, "adapter": adapter_params}
    if code != 0:
        stages["plan"]["error"] = first_error_line(log)

    # Independent of lora-tune's own probes (they run on a shrunk twin): the saved model itself.
    leak = packing_probe(model)
    stages["packing"] = {"packed": packed, "leak": leak}
    if chunked:
        stages["loss"] = {"chunked": True, "head": head_probe(model)}

    failures = [f"adapter: LoRA outside the language model ({outside[0]})"] if outside else []
    if not stages["merge"]["drift"] <= 1e-4:
        failures.append(f"merge: merged logits drift {stages['merge']['drift']:.1e} from base + adapter (peft)")
    if not stages["merge"]["same_names"]:
        failures.append("merge: the merged folder names its tensors differently from the base")
    if plan is None:
        failures.append(f"plan: {stages['plan']['error']}")
    elif plan != adapter_params:
        failures.append(f"plan: {plan:,} LoRA parameters, the adapter has {adapter_params:,}")
    if packed and leak is not None:
        failures.append(f"packing: packed although {leak}")
    if chunked and stages["loss"]["head"] is not None:
        failures.append(f"loss: chunked although {stages['loss']['head']}")
    row["status"], row["reason"] = ("fails", failures[0]) if failures else ("✓", "")
    return row


def run_one(model_type: str, root: Path, keep: bool) -> dict:
    """check_family in a fresh interpreter (one model's memory and state never reach the next)."""
    out = root / f"{model_type}.json"
    t0 = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model_type, "--workdir", str(root / model_type), "--result", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT + 60, env=env)
        tail = proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        tail = f"timed out after {TIMEOUT + 60}s"
    row = json.loads(out.read_text()) if out.is_file() else None
    if row is None:
        row = {"model_type": model_type, "stages": {}, "status": "fails", "reason": f"worker: {first_error_line(tail)}"}
    row["wall_seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(row, indent=1, default=str))
    if not keep:
        shutil.rmtree(root / model_type, ignore_errors=True)
    return row


def worker(model_type: str, workdir: Path, result: Path) -> None:
    import warnings

    import torch

    torch.set_num_threads(1)

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    def expire(signum, frame):
        raise Timeout(f"timed out after {TIMEOUT}s")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(TIMEOUT)
    try:
        row = check_family(model_type, workdir)
    except Timeout as e:
        row = {"model_type": model_type, "stages": {}, "status": "fails", "reason": str(e)}
    result.write_text(json.dumps(row, indent=1, default=str))


def write_report(rows: list[dict], wall: float, md: Path) -> str:
    import transformers

    counts = Counter(r["status"] for r in rows)
    lines = [
        f"# Family sweep (transformers {transformers.__version__}, fp32 on CPU)",
        "",
        "Generated by `python benchmarks/family_sweep.py`: every model type in transformers' causal-LM and image-text-to-text "
        "mappings, a tiny random model of each, trained 2 steps, merged (merged logits == base + adapter through peft), planned "
        "(plan's LoRA count == the adapter's) and packed (exact, or refused with a log line).",
        "",
        f"{len(rows)} model types: **{counts.get('✓', 0)} ✓, {counts.get('refused', 0)} refused, {counts.get('fails', 0)} fail**, "
        f"{counts.get('n/a', 0)} n/a (no tiny text-only model). Wall time {wall / 60:.0f} min, one model type at a time on 2 shared "
        "CPU cores.",
        "",
        "| family | class | status | params | train s | packing | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["model_type"]):
        s = r["stages"]
        status = r["status"] if r["status"] == "✓" else f"{r['status']}: {r['reason']}"
        params = s.get("build", {}).get("parameters")
        packing = "-"
        if "packing" in s:
            packing = "packs (exact)" if s["packing"]["packed"] else "padded (refused)"
        notes = "; ".join(line.split("] ")[-1].split(" - ")[-1] for line in s.get("train", {}).get("log", []))
        cells = [r["model_type"], s.get("build", {}).get("class", "-"), status, f"{params / 1e6:.2f}M" if params else "-"]
        cells += [str(s.get("train", {}).get("seconds", "-")), packing, notes]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    md.with_suffix(".json").write_text(
        json.dumps({"transformers": transformers.__version__, "wall_seconds": round(wall, 1), "rows": rows}, indent=1, default=str)
    )
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated model types")
    p.add_argument("--fast", action="store_true", help=f"the CI subset: {', '.join(FAST)}")
    p.add_argument("--workdir", default="/tmp/lora-tune-family-sweep", help="models, adapters and per-type results")
    p.add_argument("--keep", action="store_true", help="keep each type's models and adapters")
    p.add_argument("--skip-done", action="store_true", help="reuse per-type results already in --workdir")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from the per-type results in --workdir")
    p.add_argument("--output", default=str(RESULTS / "family_sweep.md"), help="markdown report (the JSON goes beside it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, Path(a.workdir), Path(a.result))
        return 0
    types = a.only.split(",") if a.only else list(FAST) if a.fast else all_types()
    root = Path(a.workdir)
    root.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for t in types:
        done = root / f"{t}.json"
        if (a.report_only or a.skip_done) and done.is_file():
            rows.append(json.loads(done.read_text()))
        elif not a.report_only:
            rows.append(run_one(t, root, a.keep))
            r = rows[-1]
            print(f"{t:28s} {r['status']:8s} {r['wall_seconds']:6.1f}s {r['reason'][:150]}", flush=True)
    wall = sum(r.get("wall_seconds", 0) for r in rows) if a.report_only or a.skip_done else time.perf_counter() - t0
    print(write_report(rows, wall, Path(a.output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
