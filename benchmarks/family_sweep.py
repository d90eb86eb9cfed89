"""Every family transformers implements, tried as a new user would: build, train, merge, plan, pack.

For every model type in transformers' causal-LM and image-text-to-text auto mappings, a tiny random
model is built from its default config (`lora_tune.tiny_configs.shrink_config`: 2-4 layers keeping the
layer pattern, hidden 64, <= 4 experts, the tiny 512-token BPE tokenizer with a chat template), saved
with save_pretrained (image-text types through AutoModelForImageTextToText: the layout their real
checkpoints have) and then, as separate timed stages with their own timeouts, recorded even when one fails:

  build    shrink, instantiate (seeded), forward on text, save_pretrained + tokenizer
  meta     the model on the meta device: parameter count equal to the instantiated one
  decoder  the structural decoder (`get_decoder()`) returns last_hidden_state that the output
           embeddings turn into the model's logits; does `base_model_prefix` name it too
  stream   would lora-tune load it layer by layer (lora_tune.layerwise.build_skeleton) or refuse
  train    `python -m lora_tune train ... --precision fp32 --max-steps 2 --rank 4` on a small alpaca file
  merge    `python -m lora_tune merge --dtype fp32`, then merged logits vs base + adapter through peft
  plan     `python -m lora_tune plan --base DIR --rank 4 --json` trainable_parameters vs the adapter's
  packing  3 samples packed in one row (position_ids restarting, no mask, use_cache=False) vs each
           alone (max |diff|); and one packed sample changed: are the others' logits bit-identical?
           Compared with what lora-tune decides (model_loading.packing_refusal).

A row is ✓ when every stage passes, "refused (reason)" when lora-tune declines the model in one
`error:` line, "fails (stage: first error line)" otherwise, and "n/a (reason)" when no tiny model of
the type can be built or run on text alone (not a text model, or its default config does not build).

    python benchmarks/family_sweep.py                    # everything, one model at a time
    python benchmarks/family_sweep.py --fast             # the CI subset
    python benchmarks/family_sweep.py --only llama,gemma3 --jobs 2
    python benchmarks/family_sweep.py --report-only      # regenerate the table from saved results

Results: benchmarks/results/family_sweep.md (table + timings) and family_sweep.json (every detail).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# The CI subset: one of each structure the issue names (dense, MoE with shared experts / dense first
# layers / MLA, hybrid linear attention, SSM hybrids, image-text wrappers, Llama 4).
FAST = (
    "llama",
    "qwen3",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_text",
    "jamba",
    "gemma3",
    "mistral3",
    "llama4_text",
)

MAX_TINY_PARAMS = 30_000_000
TIMEOUTS = {"build": 120, "train": 420, "merge": 300, "plan": 180, "packing": 120, "worker": 1500}
ALPACA = [
    {"instruction": f"Add {a} and {a + 1}.", "input": "" if a % 2 else "numbers", "output": f"The answer is {2 * a + 1}."}
    for a in range(12)
]
# Names of non-language-model parts in image-text checkpoints: an adapter touching them adapts more than the LM.
VISION_HINTS = ("vision", "visual", "multi_modal_projector", "mm_projector", "image_newline", "vqmodel", "audio", "patch_embed", "merger.")


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


def env() -> dict:
    e = dict(os.environ)
    e.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""),
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    return e


def first_error_line(text: str) -> str:
    """The line that says what went wrong: lora-tune's `error:` line, else a traceback's last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1][:300]
    tb = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    if tb:
        tail = [line for line in lines[tb[-1] :] if not line.startswith(("File ", "^", "~")) and not line.startswith("Traceback")]
        exc = [line for line in tail if ":" in line and line.split(":")[0].replace(".", "").replace("_", "").isalnum()]
        return (exc[-1] if exc else tail[-1] if tail else lines[-1])[:300]
    return (lines[-1] if lines else "no output")[:300]


def run_cli(args: list[str], timeout: float, log: Path) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lora_tune", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env(),
            cwd=str(log.parent),
        )
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = (
            (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
            (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or ""),
            "timeout",
        )
    log.write_text(f"$ lora-tune {' '.join(map(str, args))}\n--- stdout\n{out}\n--- stderr\n{err}\n")
    return {"code": code, "seconds": round(time.perf_counter() - t0, 1), "stdout": out, "stderr": err}


# --- the worker: one model type -------------------------------------------------------------------
class StageTimeout(Exception):
    pass


def _alarm(seconds: int):
    import signal

    def handler(signum, frame):
        raise StageTimeout(f"timed out after {seconds}s")

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


def stage(result: dict, name: str, fn, timeout: int | None = None) -> object:
    """Run fn() as a recorded stage; returns its value, or None when it raised."""
    import signal

    t0 = time.perf_counter()
    if timeout:
        _alarm(timeout)
    try:
        value = fn()
        result["stages"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2), **(value if isinstance(value, dict) else {})}
        return value if value is not None else True
    except Exception as e:  # noqa: BLE001 - every failure is a result
        text = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        msg = " ".join(text[:2]) if text and text[0].endswith(":") else (text[0] if text else "")
        line = f"{type(e).__name__}: {msg[:240]}"
        result["stages"][name] = {
            "ok": False,
            "seconds": round(time.perf_counter() - t0, 2),
            "error": line,
            "traceback": traceback.format_exc()[-3000:],
        }
        return None
    finally:
        if timeout:
            signal.alarm(0)


def describe(text) -> str:
    """Layers, hidden size and experts of a text config, for the table."""
    parts = []
    for label, keys in (("L", ("num_hidden_layers", "n_layer", "num_layers")), ("h", ("hidden_size", "d_model", "n_embd"))):
        value = next((getattr(text, k, None) for k in keys if getattr(text, k, None) is not None), None)
        parts.append(f"{label}={value}")
    experts = next(
        (getattr(text, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(text, k, None)), None
    )
    return " ".join(parts + ([f"E={experts}"] if experts else []))


def auto_class(model_type: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return AutoModelForImageTextToText if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else AutoModelForCausalLM


def text_ids(n: int, seed: int):
    import torch

    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def logits_of(model, **kw):
    import torch

    with torch.no_grad():
        return model(**kw, use_cache=False).logits.float()


def worker(model_type: str, workdir: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    from lora_tune.tiny_configs import shrink_config
    from lora_tune.tiny_model import train_tiny_tokenizer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    result: dict = {"model_type": model_type, "stages": {}, "notes": []}
    auto = auto_class(model_type)
    result["auto_class"] = auto.__name__
    base = workdir / "base"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    holder: dict = {}

    def build():
        config = shrink_config(CONFIG_MAPPING[model_type]())
        with torch.device("meta"):  # size first: a tower the rules can't shrink must not be allocated (host RAM is shared)
            n = sum(p.numel() for p in auto.from_config(config).parameters())
        if n > MAX_TINY_PARAMS:
            raise RuntimeError(f"shrunk model still has {n / 1e6:.0f}M parameters (limit {MAX_TINY_PARAMS / 1e6:.0f}M)")
        torch.manual_seed(0)
        model = auto.from_config(config).eval()
        holder["model"], holder["config"] = model, config
        logits_of(model, input_ids=text_ids(12, 0))  # runs on text alone
        tok = train_tiny_tokenizer()
        model.save_pretrained(base)
        tok.save_pretrained(base)
        (base / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
        return {"class": type(model).__name__, "parameters": n, "shape": describe(config.get_text_config(decoder=True))}

    if stage(result, "build", build, TIMEOUTS["build"]) is None:
        return result
    model, config = holder["model"], holder["config"]
    result["class"] = type(model).__name__

    def meta():
        with torch.device("meta"):
            skeleton = auto.from_config(config)
        n = sum(p.numel() for p in skeleton.parameters())
        from lora_tune.planner.architecture import load_architecture

        plan_total = None
        try:
            plan_total = load_architecture(str(base)).total
        except Exception as e:  # noqa: BLE001
            result["notes"].append(f"planner Architecture: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        out = {
            "parameters": n,
            "equal": n == result["stages"]["build"]["parameters"],
            "plan_total": plan_total,
            "plan_total_equal": plan_total == result["stages"]["build"]["parameters"],
        }
        if not out["equal"]:
            raise AssertionError(f"meta skeleton {n} vs instantiated {result['stages']['build']['parameters']}")
        return out

    stage(result, "meta", meta, 60)

    def decoder():
        ids = text_ids(10, 1)
        want = logits_of(model, input_ids=ids)
        out: dict = {"base_model_prefix": model.base_model_prefix}
        prefixed = getattr(model, model.base_model_prefix, None)
        from lora_tune.model_structure import decoder_body

        dec = decoder_body(model)
        out["get_decoder"] = type(dec).__name__ if dec is not None else None
        out["prefix_module"] = type(prefixed).__name__ if prefixed is not None else None
        head = model.get_output_embeddings()
        out["head"] = type(head).__name__ if head is not None else None
        scale_keys = [
            k
            for k in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier")
            if getattr(getattr(config, "text_config", config), k, None) not in (None, 1, 1.0)
        ]
        out["logit_transforms"] = scale_keys

        def check(body):
            with torch.no_grad():
                o = body(input_ids=ids, use_cache=False)
            h = o.last_hidden_state if hasattr(o, "last_hidden_state") else o[0]
            got = head(h).float()
            return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))

        for label, body in (("get_decoder", dec), ("prefix", prefixed)):
            if body is None:
                out[f"{label}_drift"] = None
                continue
            try:
                out[f"{label}_drift"] = check(body)
            except Exception as e:  # noqa: BLE001
                out[f"{label}_drift"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        ok = isinstance(out["get_decoder_drift"], float) and (out["get_decoder_drift"] < 1e-5 or scale_keys)
        if not ok:
            raise AssertionError(f"get_decoder() -> {out['get_decoder']}: {out['get_decoder_drift']}")
        return out

    stage(result, "decoder", decoder, 60)

    def conversion():
        from safetensors import safe_open
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        files = sorted(base.glob("*.safetensors"))
        disk = set()
        for f in files:
            with safe_open(str(f), "pt") as h:
                disk |= set(h.keys())
        module = set(model.state_dict().keys())
        mapping = get_checkpoint_conversion_mapping(config.model_type) or []
        out = {
            "disk_equals_module": disk == module,
            "disk_only": sorted(disk - module)[:4],
            "module_only": sorted(module - disk)[:4],
            "conversion_rules": [type(m).__name__ for m in mapping][:12],
            "n_conversion_rules": len(mapping),
        }
        from lora_tune.layerwise import NotStreamable, build_skeleton

        try:
            build_skeleton(str(base), "fp32", False)
            out["layer_by_layer"] = "streamable"
        except NotStreamable as e:
            out["layer_by_layer"] = f"refused: {e}"
        except Exception as e:  # noqa: BLE001
            out["layer_by_layer"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return out

    stage(result, "conversion", conversion, 60)

    def packing():
        from lora_tune.model_loading import packing_refusal

        lengths, seeds = (13, 17, 11), (11, 12, 13)
        samples = [text_ids(n, s) for n, s in zip(lengths, seeds)]
        packed = torch.cat(samples, dim=1)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        got = logits_of(model, input_ids=packed, position_ids=positions)
        diffs, at = [], 0
        for s, n in zip(samples, lengths):
            alone = logits_of(model, input_ids=s, position_ids=torch.arange(n).unsqueeze(0))
            diffs.append(float((got[0, at : at + n] - alone[0]).abs().max()))
            at += n
        changed = [s.clone() for s in samples]
        changed[1][0, 5] = (changed[1][0, 5] + 7) % 500 + 3
        got2 = logits_of(model, input_ids=torch.cat(changed, dim=1), position_ids=positions)
        a, b = lengths[0], lengths[0] + lengths[1]
        identical = bool(torch.equal(got[0, :a], got2[0, :a]) and torch.equal(got[0, b:], got2[0, b:]))
        after_identical = bool(torch.equal(got[0, b:], got2[0, b:]))
        scale = float(got.abs().max())
        exact = max(diffs) <= 1e-4 * max(1.0, scale) and identical
        try:
            refusal = packing_refusal(config)
        except Exception as e:  # noqa: BLE001
            refusal = f"(packing_refusal raised {type(e).__name__})"
        return {
            "max_diff_vs_unpacked": max(diffs),
            "per_sample": diffs,
            "others_bit_identical": identical,
            "later_sample_bit_identical": after_identical,
            "exact": exact,
            "lora_tune_packs": refusal is None,
            "lora_tune_refusal": refusal,
        }

    stage(result, "packing", packing, TIMEOUTS["packing"])
    holder.clear()  # the instance is not needed by the CLI stages

    data = workdir / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ALPACA))
    adapter = workdir / "adapter"
    run = run_cli(
        [
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
            "--optim",
            "adamw",
            "--max-seq-len",
            64,
            "--micro-batch-size",
            2,
            "--data-cache-dir",
            workdir / "cache",
        ],
        TIMEOUTS["train"],
        workdir / "train.log",
    )
    train = {"ok": run["code"] == 0, "seconds": run["seconds"], "code": run["code"]}
    if run["code"] != 0:
        train["error"] = first_error_line(run["stderr"] + run["stdout"])
        train["refused"] = run["code"] == 2 and train["error"].startswith("error:") and "Traceback" not in run["stderr"]
    for line in run["stderr"].splitlines():
        for key in ("LoRA targets:", "packing off:", "chunked loss off:", "attention:", "trainable parameters:"):
            if key in line:
                train.setdefault("log", []).append(line.split(" - ")[-1].strip()[:300])
    result["stages"]["train"] = train
    if not train["ok"]:
        return result

    def adapter_facts():
        from safetensors import safe_open

        with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
            n = sum(f.get_slice(k).get_shape().__len__() and __import__("math").prod(f.get_slice(k).get_shape()) for k in keys)
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        outside = [k for k in keys if any(h in k for h in VISION_HINTS)]
        return {
            "parameters": int(n),
            "tensors": len(keys),
            "target_modules": cfg.get("target_modules"),
            "target_parameters": cfg.get("target_parameters"),
            "outside_language_model": outside[:4],
            "n_outside_language_model": len(outside),
        }

    facts = stage(result, "adapter", adapter_facts, 60)

    merged = workdir / "merged"
    run = run_cli(["merge", "--adapter", adapter, "--output", merged, "--dtype", "fp32"], TIMEOUTS["merge"], workdir / "merge.log")
    merge = {"ok": run["code"] == 0, "seconds": run["seconds"], "code": run["code"]}
    if run["code"] != 0:
        merge["error"] = first_error_line(run["stderr"] + run["stdout"])
    else:
        merge["route"] = "whole model (transformers)" if "whole model in host memory" in run["stderr"] else "streaming"

        def compare():
            from peft import PeftModel

            ref = PeftModel.from_pretrained(auto.from_pretrained(base, dtype=torch.float32), adapter).eval()
            ids = text_ids(24, 3)
            want = logits_of(ref, input_ids=ids)
            del ref
            got = logits_of(auto.from_pretrained(merged, dtype=torch.float32).eval(), input_ids=ids)
            drift = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
            from safetensors import safe_open

            names = lambda folder: set().union(*[set(safe_open(str(f), "pt").keys()) for f in folder.glob("*.safetensors")])  # noqa: E731
            same_layout = names(base) == names(merged)
            if not drift <= 1e-4:
                raise AssertionError(f"merged logits drift {drift:.2e} from base + adapter (peft)")
            return {"drift": drift, "same_names_as_base": same_layout}

        sub: dict = {"stages": {}}
        stage(sub, "compare", compare, 120)
        merge.update({k: v for k, v in sub["stages"]["compare"].items() if k not in ("seconds",)})
        merge["ok"] = sub["stages"]["compare"]["ok"]
        if not merge["ok"]:
            merge["error"] = sub["stages"]["compare"]["error"]
    result["stages"]["merge"] = merge

    run = run_cli(["plan", "--base", base, "--rank", 4, "--json"], TIMEOUTS["plan"], workdir / "plan.log")
    plan = {"seconds": run["seconds"], "code": run["code"]}
    if run["code"] == 0:
        try:
            plan["trainable_parameters"] = json.loads(run["stdout"])["trainable_parameters"]
        except (json.JSONDecodeError, KeyError) as e:
            plan["error"] = f"unreadable plan output ({e})"
    else:
        plan["error"] = first_error_line(run["stderr"] + run["stdout"])
    if facts and "trainable_parameters" in plan:
        plan["adapter_parameters"] = facts["parameters"]
        plan["relative_error"] = (plan["trainable_parameters"] - facts["parameters"]) / facts["parameters"]
        if plan["trainable_parameters"] != facts["parameters"]:
            plan["error"] = (
                f"plan {plan['trainable_parameters']:,} vs adapter {facts['parameters']:,} LoRA parameters "
                f"({100 * plan['relative_error']:+.1f}%)"
            )
    plan["ok"] = "error" not in plan
    result["stages"]["plan"] = plan
    return result


# --- the driver ------------------------------------------------------------------------------------
def run_one(model_type: str, root: Path, keep: bool) -> dict:
    workdir = root / model_type
    out = root / f"{model_type}.json"
    t0 = time.perf_counter()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model_type, "--workdir", str(workdir), "--result", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUTS["worker"], env=env())
        tail = (proc.stderr or "")[-2000:]
        code = proc.returncode
    except subprocess.TimeoutExpired:
        tail, code = "", "timeout"
    if out.is_file():
        result = json.loads(out.read_text())
    else:
        result = {
            "model_type": model_type,
            "stages": {"worker": {"ok": False, "error": f"worker ended without a result (exit {code}): {first_error_line(tail)}"}},
        }
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    result["status"], result["reason"] = classify(result)
    out.write_text(json.dumps(result, indent=1, default=str))
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


NOT_TEXT = (
    "pixel_values",
    "flattened_patches",
    "bbox",
    "qformer_input_ids",
    "image_embeds",
    "encoder_outputs",
    "set_default_language",
    "shared_kv_states",
    "missing 1 required positional argument: 'state'",
    "get_seq_length",
    "image_encoder_embeddings",
)


def classify(result: dict) -> tuple[str, str]:
    """(status, one-line reason): ✓, refused, fails, or n/a."""
    s = result["stages"]
    if "worker" in s:
        return "fails", f"worker: {s['worker']['error']}"
    build = s.get("build", {})
    if not build.get("ok"):
        error = build.get("error", "")
        if any(k in error for k in NOT_TEXT):
            return "n/a", f"not a text model: its forward needs more than input_ids ({error[:140]})"
        return "n/a", f"no tiny model: {error[:180]}"
    train = s.get("train", {})
    if train and not train.get("ok"):
        if train.get("refused"):
            return "refused", train["error"].removeprefix("error: ")
        return "fails", f"train: {train.get('error', '')}"
    for name in ("merge", "plan", "packing", "decoder", "meta"):
        st = s.get(name)
        if st is None:
            continue
        if name == "packing" and st.get("ok"):
            if st["lora_tune_packs"] and not st["exact"]:
                return (
                    "fails",
                    f"packing: lora-tune packs this model but packed logits differ (max {st['max_diff_vs_unpacked']:.2e}, "
                    f"others identical: {st['others_bit_identical']})",
                )
            continue
        if not st.get("ok"):
            if name == "packing":
                if st.get("error") and not s.get("train", {}).get("ok"):
                    continue
                if any("packing off" in line for line in train.get("log", [])):
                    continue  # lora-tune did not pack; the probe could not run either
                return "fails", f"packing: {st.get('error', '')}"
            return "fails", f"{name}: {st.get('error', '')}"
    return "✓", ""


def write_report(results: list[dict], wall: float, path_md: Path, path_json: Path) -> str:
    from collections import Counter

    import transformers

    counts = Counter(r["status"] for r in results)
    stage_names = ("build", "meta", "decoder", "conversion", "packing", "train", "merge", "plan")
    per_stage = {n: Counter() for n in stage_names}
    for r in results:
        for n in stage_names:
            st = r["stages"].get(n)
            if st is not None:
                per_stage[n]["ok" if st.get("ok") else "refused" if st.get("refused") else "failed"] += 1
    lines = [
        f"# Family sweep (transformers {transformers.__version__}, fp32 on CPU)",
        "",
        f"{len(results)} model types; {counts.get('✓', 0)} ✓, {counts.get('refused', 0)} refused, {counts.get('fails', 0)} fail, "
        f"{counts.get('n/a', 0)} n/a (no text-only tiny model). Wall time {wall / 60:.1f} min (one model at a time, 2 shared CPU cores).",
        "",
        "Per stage (ok / refused / failed; a stage not reached is not counted):",
        "",
        "| stage | ok | refused | failed |",
        "|---|---|---|---|",
    ]
    for n in stage_names:
        c = per_stage[n]
        lines.append(f"| {n} | {c['ok']} | {c['refused']} | {c['failed']} |")
    lines += [
        "",
        "| family | auto class | status | train s | merge s | params | packing (lora-tune / behaviour) | layer by layer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["model_type"]):
        s = r["stages"]
        status = r["status"] if r["status"] in ("✓",) else f"{r['status']} ({r['reason']})"
        pk = s.get("packing", {})
        if pk.get("ok"):
            behaviour = "exact" if pk["exact"] else f"leaks ({pk['max_diff_vs_unpacked']:.1e})"
            packing = f"{'packs' if pk['lora_tune_packs'] else 'refuses'} / {behaviour}"
        else:
            packing = "-" if not pk else "probe failed"
        conv = s.get("conversion", {})
        lbl = conv.get("layer_by_layer", "-")
        lbl = "streamable" if lbl == "streamable" else "refused" if str(lbl).startswith("refused") else "-" if lbl == "-" else "error"
        train = s.get("train", {})
        merge = s.get("merge", {})
        params = s.get("build", {}).get("parameters")
        lines.append(
            f"| {r['model_type']} | {r.get('auto_class', '-').replace('AutoModelFor', '')} | {status.replace('|', '/')} | "
            f"{train.get('seconds', '-')} | {merge.get('seconds', '-')} | {f'{params / 1e6:.2f}M' if params else '-'} | {packing} | {lbl} |"
        )
    text = "\n".join(lines) + "\n"
    path_md.parent.mkdir(parents=True, exist_ok=True)
    path_md.write_text(text)
    slim = [{k: v for k, v in r.items()} for r in results]
    for r in slim:
        for st in r["stages"].values():
            st.pop("traceback", None)
    path_json.write_text(
        json.dumps({"transformers": transformers.__version__, "wall_seconds": round(wall, 1), "results": slim}, indent=1, default=str)
    )
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated model types")
    p.add_argument("--fast", action="store_true", help=f"the CI subset: {', '.join(FAST)}")
    p.add_argument("--jobs", type=int, default=1, help="model types tried at once (default 1)")
    p.add_argument("--workdir", default=None, help="where models, adapters and per-type results go (default: a folder under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep each type's models and adapters")
    p.add_argument("--skip-done", action="store_true", help="reuse per-type results already in --workdir")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from the per-type results in --workdir")
    p.add_argument("--output", default=str(RESULTS / "family_sweep.md"), help="markdown report (the JSON goes beside it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        import warnings

        warnings.filterwarnings("ignore")
        result = worker(a.worker, Path(a.workdir))
        Path(a.result).write_text(json.dumps(result, indent=1, default=str))
        return 0
    types = a.only.split(",") if a.only else list(FAST) if a.fast else all_types()
    root = Path(a.workdir or "/tmp/lora-tune-family-sweep")
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    if a.report_only:
        results = [json.loads((root / f"{t}.json").read_text()) for t in types if (root / f"{t}.json").is_file()]
    else:
        todo = []
        for t in types:
            done = root / f"{t}.json"
            if a.skip_done and done.is_file() and "status" in json.loads(done.read_text()):
                results.append(json.loads(done.read_text()))
            else:
                todo.append(t)

        def one(t):
            r = run_one(t, root, a.keep)
            print(f"{t:28s} {r['status']:8s} {r['wall_seconds']:6.1f}s {r['reason'][:150]}", flush=True)
            return r

        with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            results += list(pool.map(one, todo))
    wall = time.perf_counter() - t0
    if a.report_only or a.skip_done:
        wall = sum(r.get("wall_seconds", 0) for r in results)
    out = Path(a.output)
    text = write_report(results, wall, out, out.with_suffix(".json"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
