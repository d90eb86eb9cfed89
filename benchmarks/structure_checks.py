"""Structural facts about every family, checked in one process on tiny random models (no training):

body      lora_tune.models.structure.decoder_body(model): head(body(ids).last_hidden_state) == logits?
          and the same for getattr(model, base_model_prefix) and model.get_decoder()
outside   modules outside the language model (vision tower, projector...) of image-text wrappers
stateful  layers with a recurrent/conv state per transformers' cache classes (model_structure.stateful_layers)
packing   model_structure.packing_probe: packed row vs each sample alone, others bit-identical
targets   lora-tune's default targets resolved on the whole model vs on the decoder body only, and
          what peft 0.21 actually adapts (its transformers-v5 MoE target conversion) vs lora-tune's request

  python benchmarks/structure_checks.py [--only a,b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings


def check(model_type: str) -> dict:
    import torch
    from transformers import CONFIG_MAPPING

    from lora_tune.models.structure import (
        decoder_body,
        outside_language_model,
        packing_probe,
        stateful_layers,
    )
    from lora_tune.models.tiny.configs import shrink_config

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from family_sweep import auto_class

    r: dict = {"model_type": model_type}
    config = shrink_config(CONFIG_MAPPING[model_type]())
    with torch.device("meta"):  # never allocate a model the rules could not shrink
        n = sum(p.numel() for p in auto_class(model_type).from_config(config).parameters())
    if n > 30_000_000:
        raise RuntimeError(f"shrunk model still has {n / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = auto_class(model_type).from_config(config).eval()
    r["class"] = type(model).__name__
    ids = torch.randint(3, 500, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
    head = model.get_output_embeddings()

    def drift(body):
        try:
            with torch.no_grad():
                out = body(input_ids=ids, use_cache=False)
            h = getattr(out, "last_hidden_state", None)
            if h is None:
                return "no last_hidden_state"
            return float((head(h).float() - want).abs().max() / want.abs().max())
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"

    body = decoder_body(model)
    r["body"] = type(body).__name__
    r["body_drift"] = drift(body)
    prefixed = getattr(model, model.base_model_prefix, None)
    r["prefix"] = model.base_model_prefix
    r["prefix_drift"] = drift(prefixed) if prefixed is not None else f"no attribute {model.base_model_prefix!r}"
    r["get_decoder"] = type(model.get_decoder()).__name__
    r["get_decoder_drift"] = drift(model.get_decoder())
    text = getattr(config, "get_text_config", lambda **_: config)(decoder=True)
    r["logit_transforms"] = [
        k
        for k in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier")
        if getattr(text, k, None) not in (None, 1, 1.0)
    ]
    r["outside_language_model"] = outside_language_model(model)
    r["stateful_layers"] = stateful_layers(config)
    try:
        r["packing"] = packing_probe(model)
    except Exception as e:  # noqa: BLE001
        r["packing"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"}
    # LoRA targets: lora-tune's default on the whole model vs on the body; what peft makes of them.
    from peft import get_peft_model

    from lora_tune.config import TrainConfig
    from lora_tune.models.targets import Inventory, lora_config, resolve_targets

    cfg = TrainConfig(base="x", data="x.jsonl", output_dir="o", rank=4)
    try:
        targets = resolve_targets(model, cfg)
        body_inv = Inventory.of(body)
        r["targets"] = {
            "modules": list(targets.modules),
            "parameters": list(targets.parameters),
            "modules_outside_body": sorted(set(targets.modules) - set(body_inv.linears)),
            "conv_as_expert": [p for p in targets.parameters if "conv" in p],
        }
        want_count = 0
        for name, m in model.named_modules():
            if name.rsplit(".", 1)[-1] in targets.modules and isinstance(m, torch.nn.Linear) and any(x.isdigit() for x in name.split(".")):
                want_count += cfg.rank * (m.in_features + m.out_features)
        peft_model = get_peft_model(model, lora_config(cfg, targets))
        got = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        pc = peft_model.peft_config["default"]
        r["peft"] = {
            "trainable": got,
            "linear_lora_requested": want_count,
            "target_modules_after": sorted(pc.target_modules),
            "target_parameters_after": sorted(pc.target_parameters or []),
            "rank_pattern": dict(pc.rank_pattern or {}),
            "rewritten": sorted(pc.target_modules) != sorted(targets.modules),
        }
    except Exception as e:  # noqa: BLE001
        r["targets_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return r


def main() -> int:
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from family_sweep import all_types

    p = argparse.ArgumentParser()
    p.add_argument("--only")
    p.add_argument("--json")
    a = p.parse_args()
    out = []
    for t in a.only.split(",") if a.only else all_types():
        t0 = time.perf_counter()
        try:
            r = check(t)
        except Exception as e:  # noqa: BLE001
            r = {"model_type": t, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        r["seconds"] = round(time.perf_counter() - t0, 2)
        out.append(r)
        if "error" in r:
            print(f"{t:26s} n/a  {r['error'][:120]}", flush=True)
            continue
        pk = r["packing"]

        def fmt(v):
            return v if isinstance(v, str) else f"{v:.0e}"

        print(
            f"{t:26s} body={r['body']}:{fmt(r['body_drift'])} prefix={fmt(r['prefix_drift'])} stateful={len(r['stateful_layers'])} "
            f"packing={'exact' if pk.get('exact') else pk.get('error', 'leaks')} outside={len(r['outside_language_model'])} "
            f"peft_rewrote={r.get('peft', {}).get('rewritten')}",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
