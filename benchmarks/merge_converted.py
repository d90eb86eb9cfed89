"""Merging an adapter into a checkpoint that transformers converts on load: streamed vs whole model.

Mixtral and Qwen3-MoE checkpoints store one tensor per expert (`experts.3.w1.weight`,
`experts.3.gate_proj.weight`); transformers fuses them into 3-D parameters on load, and an adapter
trained on the fused tensors (peft's target_parameters) names those. Two routes to the merged model:

  whole model   transformers + peft: from_pretrained (the whole model in host memory), PeftModel,
                merge_and_unload(), save_pretrained (which converts back to per-expert tensors)
  lora-tune     `lora-tune merge`: shard by shard; each adapted fused tensor is built from its disk
                tensors, merged and converted back with transformers' own conversion mapping, one
                tensor group at a time

Each runs in a fresh interpreter that reports its peak RSS (VmHWM) and time; the outputs are compared
tensor by tensor (same names, values in fp32). Checkpoints: ~1 GB in fp32, in 50 MB shards (the merged output in 100 MB ones); adapter
rank 16 on q/v and on the fused experts, random (non-zero) B.

    python benchmarks/merge_converted.py [--workdir DIR] [--only mixtral] [--layers 24]

Results: benchmarks/results/merge_converted.md
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

# benchmarks/ is on sys.path: these run as scripts. The two routes are merge_vs_peft's (usual = whole model).
from merge_vs_peft import IMPORTS, OURS, USUAL, run

SHARD = "50MB"

FAMILIES = {
    # 8 experts of 1024 x 1024 (w1/w3/w2 on disk), 8 layers: 0.98 GB fp32.
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=1024),
    # 32 experts of 1024 x 256 (gate/up/down_proj on disk), 8 layers, q/k norms: 0.88 GB fp32.
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, head_dim=64),
}
COMMON = dict(
    vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False
)


def build(family: str, workdir: Path) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    base, adapter = workdir / family / "base", workdir / family / "adapter"
    if (base / "model.safetensors.index.json").exists() and (adapter / "adapter_model.safetensors").exists():
        return base, adapter
    spec = dict(FAMILIES[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **COMMON, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(base, max_shard_size=SHARD)
    lora = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    get_peft_model(model, lora).save_pretrained(adapter)
    return base, adapter


def compare(a: Path, b: Path) -> tuple[bool, float]:
    """(same tensor names, max |difference| relative to the largest value)."""
    from safetensors import safe_open

    def names(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    x, y = names(a), names(b)
    worst = 0.0
    for k in x.keys() & y.keys():
        with safe_open(str(x[k]), framework="pt") as f, safe_open(str(y[k]), framework="pt") as g:
            s, t = f.get_tensor(k).float(), g.get_tensor(k).float()
        worst = max(worst, float((s - t).abs().max() / s.abs().max().clamp_min(1e-12)))
    return x.keys() == y.keys(), worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--only", default=",".join(FAMILIES))
    parser.add_argument("--layers", type=int, default=COMMON["num_hidden_layers"], help="decoder layers (the model's size)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="merge-converted-"))
    _, _, import_rss = run(IMPORTS)
    print(f"importing torch + transformers + peft + lora_tune.after.merge alone: {import_rss / 2**30:.2f} GiB peak RSS")
    header = f"{'checkpoint':<12} {'size GB':>8} {'shards':>7} {'route':<12} {'peak RSS GiB':>13} {'s':>6}"
    print(f"{header} {'same names':>11} {'max rel diff':>13}")
    COMMON["num_hidden_layers"] = args.layers
    for family in args.only.split(","):
        root = workdir / f"layers-{args.layers}"
        base, adapter = build(family, root)
        size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
        shards = len(list(base.glob("*.safetensors")))
        outs = {}
        for route, code in (("whole model", USUAL), ("lora-tune", OURS)):
            out = root / family / route.replace(" ", "_")
            subprocess.run(["rm", "-rf", str(out)])
            wall, seconds, rss = run(code, base, adapter, out)
            outs[route] = out
            same, diff = compare(outs["whole model"], out) if route != "whole model" else (True, 0.0)
            row = f"{family:<12} {size / 1e9:>8.2f} {shards:>7} {route:<12} {rss / 2**30:>13.2f} {seconds:>6.1f}"
            print(f"{row} {same!s:>11} {diff:>13.1e}")


if __name__ == "__main__":
    main()
