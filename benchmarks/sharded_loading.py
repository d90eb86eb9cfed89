"""Per-rank peak memory while a base loads, layer by layer (ZeRO-3 with quantized bases, FSDP2) vs
whole per rank (how ZeRO-2 loads, and how quantized bases loaded under ZeRO-3 before).

Model: Llama-shaped, random bf16 weights (hidden 1024, intermediate 2816, 16 layers, vocab 32000:
~0.25 B parameters, 0.47 GiB in bf16), saved in ~200 MB safetensors shards. Each route runs
`lora-tune train --nproc 2` for one step; every rank prints what it holds and its peak memory
(CPU: peak RSS of the rank's process, VmHWM) right after loading. On a CPU machine the "device"
is host RAM, so that peak is the host's too. Each route also runs on a 2-layer model of hidden
size 64: what a rank needs before any model (imports, runtime, buffers); the difference between the
two is what loading this model costs the rank.

    python benchmarks/sharded_loading.py [--workdir DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

from commands import train_argv  # benchmarks/ is on sys.path: these run as scripts

ROUTES = [
    ("8bit, whole per rank (ZeRO-2)", ["--precision", "8bit", "--zero", "2"]),
    ("8bit, layer by layer (ZeRO-3)", ["--precision", "8bit", "--zero", "3"]),
    ("4bit, whole per rank (ZeRO-2)", ["--precision", "4bit", "--zero", "2"]),
    ("4bit, layer by layer (ZeRO-3)", ["--precision", "4bit", "--zero", "3"]),
    ("4bit, layer by layer (FSDP2)", ["--precision", "4bit", "--backend", "fsdp"]),
    ("bf16, whole per rank (ZeRO-2)", ["--precision", "bf16", "--zero", "2"]),
    ("bf16, layer by layer (FSDP2)", ["--precision", "bf16", "--backend", "fsdp"]),
]
PEAK = re.compile(r"rank (\d) holds .*?, peak ([\d.]+) GiB \(after loading\)")


def build_model(folder: Path, tiny: bool) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_tune.models.tiny.model import train_tiny_tokenizer

    if (folder / "config.json").exists():
        return folder
    tokenizer = train_tiny_tokenizer()
    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        if tiny
        else dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16)
    )
    config = LlamaConfig(
        vocab_size=32000,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **shape,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")
    tokenizer.save_pretrained(folder)
    return folder


def run_route(base: Path, data: Path, out: Path, flags: list[str]) -> dict:
    # DeepSpeed keeps parameters under 100k elements whole on every rank; measure its real partition.
    zero_config = out.parent / "no-persistence.json"
    zero_config.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    extra = ["--zero-config", str(zero_config)] if "3" in flags and "--zero" in flags else []
    cmd = train_argv(base, data, out, *flags, *extra, max_steps=1, max_seq_len=64, rank=8, optim="adamw", nproc=2)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    peaks = {int(r): float(g) for r, g in PEAK.findall(proc.stderr)}
    if sorted(peaks) != [0, 1]:
        raise SystemExit(f"expected a memory line from both ranks:\n{proc.stderr[-3000:]}")
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (for the test suite)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sharded-loading-"))
    base = build_model(work / ("tiny" if args.tiny else "model"), args.tiny)
    floor = build_model(work / "tiny", True)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} of the loading benchmark"}) + "\n" for i in range(8)))
    import shutil

    results = {}
    for name, flags in ROUTES:
        peaks = []
        for model in (base, floor):
            out = work / (re.sub(r"\W+", "-", name) + model.name)
            shutil.rmtree(out, ignore_errors=True)
            peaks.append(max(run_route(model, data, out, flags).values()))
        results[name] = (peaks[0], peaks[1], peaks[0] - peaks[1])
    size = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    print(f"model: {size / 2**30:.2f} GiB of bf16 safetensors; 2 ranks; peak memory per rank after loading (GiB)")
    print("| route | peak per rank | without the model | the model's part | ratio to whole per rank |")
    print("|---|---|---|---|---|")
    for name, (peak, empty, model_part) in results.items():
        whole = results[f"{name.split(',')[0]}, whole per rank (ZeRO-2)"][2]
        print(f"| {name} | {peak:.2f} | {empty:.2f} | {model_part:.2f} | {model_part / whole:.2f} |")


if __name__ == "__main__":
    main()
