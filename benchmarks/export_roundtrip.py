"""GGUF export round trips per family x format, and streaming memory on a multi-shard base.

    python benchmarks/export_roundtrip.py            # writes benchmarks/results/export_roundtrip.md

1. Tiny Llama, Qwen2, Gemma-2, Mistral models (trained in full for a few steps so their predictions
   are peaked, as tests/test_export.py does), each exported as f16, bf16 and q8_0 by `lora-tune export`
   in a fresh interpreter: max logit difference (relative) and greedy agreement of transformers' GGUF
   loader vs the merged model, tokenizer ids read back from the GGUF, export seconds, peak RSS.
2. Llama-shaped bases of 12 and 36 layers (~150 and ~430 MB fp32, ~57 MB shards) plus a rank-16
   adapter: `export RUN --quant f16` (merging on the fly) vs the merged folder's size and its largest
   shard; peak RSS net of a bare interpreter that imports the same libraries. Streaming shows as a
   net peak that stays the same when the model triples.

    python benchmarks/export_roundtrip.py --streaming-only   # part 2 alone, rewriting its section
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from peak_rss import PEAK  # noqa: E402

EXPORT = (
    PEAK
    + """
import json, sys, time
from lora_tune.after.options import ExportConfig
from lora_tune.after.export import run
t = time.perf_counter()
r = run(ExportConfig(source=sys.argv[1], output=sys.argv[2], quant=sys.argv[3], verify=sys.argv[4] == "1"))
print(json.dumps({"rel": r.max_rel_logit_diff, "agree": r.greedy_agreement, "ids": r.token_ids_equal, "write_s": r.seconds,
                  "total_s": time.perf_counter() - t, "peak": peak()}))
"""
)
IMPORTS_ONLY = (
    PEAK
    + """
import json, torch, numpy, gguf, safetensors
from lora_tune.after.export import gguf as g, run
print(json.dumps({"peak": peak()}))
"""
)


def python(code: str, *args) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def round_trips(root: Path) -> list[str]:
    from test_export import trained_family

    rows = [
        "| family | format | max logit diff (relative) | greedy agreement | tokenizer ids equal | export s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for family in ("llama", "qwen2", "gemma2", "mistral"):
        source = trained_family(family, root / family)
        for quant in ("f16", "bf16", "q8_0"):
            r = python(EXPORT, source, root / f"{family}-{quant}.gguf", quant, "1")
            rows.append(
                f"| {family} | {quant} | {r['rel']:.2e} | {100 * r['agree']:.1f}% | {'yes' if r['ids'] else 'NO'} | "
                f"{r['write_s']:.2f} | {r['peak'] / 2**20:,.0f} |"
            )
            print(rows[-1], flush=True)
    return rows


def sharded_run(root: Path, layers: int) -> tuple[Path, list[Path]]:
    """A Llama-shaped fp32 base of `layers` layers saved in ~57 MB shards, and a rank-16 run on it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_tune.models.tiny.model import build_tiny_llama

    base = build_tiny_llama(
        root / f"base-small-{layers}",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    model = AutoModelForCausalLM.from_pretrained(base)
    sharded = root / f"base-{layers}"
    model.save_pretrained(sharded, max_shard_size="60MB")
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation")):
            (sharded / f.name).write_bytes(f.read_bytes())
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            init_lora_weights=False,
        ),
    )
    run = root / f"run-{layers}"
    peft_model.save_pretrained(run)
    config = json.loads((run / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(sharded)
    (run / "adapter_config.json").write_text(json.dumps(config))
    for f in sharded.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            (run / f.name).write_bytes(f.read_bytes())
    return run, sorted(sharded.glob("model-*.safetensors"))


def streaming(root: Path) -> list[str]:
    bare = python(IMPORTS_ONLY)["peak"]
    rows = [
        "| layers | route | export s | peak RSS MiB | net of imports MiB | merged size MiB (fp32) | shards | largest shard MiB "
        "| net / largest shard |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    streamed = ("export RUN --quant f16 --no-verify (merge on the fly)", "0")
    verified = ("export RUN --quant f16 (verify: logits of two models)", "1")
    for layers, routes in ((12, (streamed, verified)), (36, (streamed,))):
        run, shards = sharded_run(root, layers)
        total, largest = sum(s.stat().st_size for s in shards), max(s.stat().st_size for s in shards)
        for label, verify in routes:
            r = python(EXPORT, run, root / f"stream-{layers}-{verify}.gguf", "f16", verify)
            net = r["peak"] - bare
            rows.append(
                f"| {layers} | {label} | {r['total_s']:.1f} | {r['peak'] / 2**20:,.0f} | {net / 2**20:,.0f} | {total / 2**20:,.0f} | "
                f"{len(shards)} | {largest / 2**20:,.0f} | {net / largest:.2f} |"
            )
            print(rows[-1], flush=True)
    rows.append(f"\nImports alone (torch, gguf, safetensors, lora_tune.after.export): {bare / 2**20:,.0f} MiB.")
    return rows


STREAMING_TITLE = "## Streaming: Llama-shaped fp32 bases in ~57 MB shards, rank-16 adapter, exported from the run"


def main() -> None:
    t0 = time.time()
    out = ROOT / "benchmarks" / "results" / "export_roundtrip.md"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "--streaming-only" in sys.argv[1:]:
            before = out.read_text().split("## Streaming")[0].rstrip().splitlines()
            table = before[2:]  # the round trips as last measured (title and blank line dropped)
        else:
            reader = (
                "Reader: transformers' GGUF loader (independent of our writer) vs the merged model, 4 fixed prompts "
                "(up to 256 positions); tokenizer rebuilt by transformers from the GGUF's metadata."
            )
            table = [reader, "", *round_trips(root)]
        stream = streaming(root)
    text = "\n".join(
        [
            "# GGUF export round trips (python benchmarks/export_roundtrip.py)",
            "",
            *table,
            "",
            STREAMING_TITLE,
            "",
            *stream,
            "",
            f"benchmark time {time.time() - t0:.0f}s on this machine",
        ]
    )
    out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
