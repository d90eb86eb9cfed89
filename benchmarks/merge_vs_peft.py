"""Side-by-side: the usual PEFT merge route vs `lora-tune merge`, same machine, same inputs.

Usual route: AutoModelForCausalLM.from_pretrained (whole model in RAM) -> PeftModel.from_pretrained
-> merge_and_unload() -> save_pretrained. Ours: `lora-tune merge` (streaming, shard by shard).

Model: Llama-shaped, ~0.8 GB in fp32 (hidden 1024, 12 layers, vocab 32000), saved in ~100 MB
shards; adapter: rank 16 on all 7 linear projections, random (non-zero) B. Each route runs in its
own fresh interpreter, which reports its peak RSS (ru_maxrss) and wall time. Outputs are compared
tensor by tensor in fp32.

    python benchmarks/merge_vs_peft.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peak_rss import PEAK  # benchmarks/ is on sys.path: these run as scripts

USUAL = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model = PeftModel.from_pretrained(model, sys.argv[2]).merge_and_unload()
model.save_pretrained(sys.argv[3], max_shard_size="100MB")
print("RESULT", time.perf_counter() - t, peak())
"""

OURS = r"""
import sys, time
from lora_tune.cli import main
t = time.perf_counter()
code = main(["merge", "--adapter", sys.argv[2], "--base", sys.argv[1], "--output", sys.argv[3], "--dtype", "fp32", "--max-shard-size", "100MB", *sys.argv[4:]])
assert code == 0
print("RESULT", time.perf_counter() - t, peak())
"""

# Baseline: what importing the libraries alone costs, so the figures can be read net of it.
IMPORTS = r"""
import torch, transformers, peft, lora_tune.after.merge
from transformers import AutoModelForCausalLM
print("RESULT", 0.0, peak())
"""


def build(workdir: Path) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lora_tune.models.tiny.model import tiny_llama_config

    base, adapter = workdir / "base", workdir / "adapter"
    if (base / "model.safetensors.index.json").exists() and (adapter / "adapter_model.safetensors").exists():
        return base, adapter
    config = tiny_llama_config(
        32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(base, max_shard_size="100MB")
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,
    )
    get_peft_model(model, lora).save_pretrained(adapter)
    return base, adapter


def run(code: str, *args) -> tuple[float, float, int]:
    """(process wall seconds incl. imports, in-script seconds after imports, peak RSS bytes)."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK + code, *map(str, args)], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")][-1]
    _, seconds, rss = line.split()
    return wall, float(seconds), int(rss)


def identical(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k)
        return out

    x, y = tensors(a), tensors(b)
    import torch

    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="merge-bench-"))
    base, adapter = build(workdir)
    size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    shards = len(list(base.glob("*.safetensors")))
    import_wall, _, import_rss = run(IMPORTS)
    results = {}
    for name, code, extra in [("usual", USUAL, []), ("lora-tune --no-verify", OURS, ["--no-verify"]), ("lora-tune (verify)", OURS, [])]:
        out = workdir / name.replace(" ", "_").replace("(", "").replace(")", "")
        subprocess.run(["rm", "-rf", str(out)])
        wall, seconds, rss = run(code, base, adapter, out, *extra)
        results[name] = {"wall_seconds": wall, "script_seconds": seconds, "peak_rss_bytes": rss, "out": out}
    usual = results["usual"]
    print(
        f"base: {size / 1e9:.2f} GB fp32 in {shards} shards; adapter rank 16, all linear; "
        f"importing torch+transformers+peft alone: {import_rss / 2**30:.2f} GiB RSS, {import_wall:.1f} s"
    )
    print(
        "wall s = the whole process as a user waits for it; script s = after the imports (the usual route imports "
        "transformers+peft before its timer, ours lazily inside)"
    )
    print(f"{'route':<24} {'wall s':>7} {'script s':>9} {'peak RSS GiB':>13} {'RSS ratio':>10} {'wall ratio':>11} {'bit-identical':>14}")
    for name, r in results.items():
        same = "-" if name == "usual" else str(identical(usual["out"], r["out"]))
        print(
            f"{name:<24} {r['wall_seconds']:>7.1f} {r['script_seconds']:>9.1f} {r['peak_rss_bytes'] / 2**30:>13.2f} "
            f"{r['peak_rss_bytes'] / usual['peak_rss_bytes']:>10.2f} {r['wall_seconds'] / usual['wall_seconds']:>11.2f} {same:>14}"
        )
    summary = {name: {k: v for k, v in r.items() if k != "out"} for name, r in results.items()}
    summary["base_bytes"], summary["import_rss_bytes"] = size, import_rss
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
