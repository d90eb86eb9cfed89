"""`lora-tune merge`: fold a LoRA adapter into the full-precision base, shard by shard, and prove it.

Streaming: each base shard is opened lazily (safetensors), each tensor is merged in fp32 and cast
once to the output dtype, and output shards are written as soon as they are full. Peak memory is
about one output shard plus one tensor group plus the adapter, never the whole model.

The output keeps the checkpoint's own names and layouts. The adapter names the loaded model's
tensors, which transformers renames or fuses on load for some checkpoints (an image-text wrapper's
`language_model.model.*`, per-expert MoE tensors fused into one 3-D parameter): each adapted tensor
is mapped to the disk tensors it is built from (`reading`, transformers' own conversion mapping);
a fused one is converted on the fly, merged, and converted back, one group at a time (`applying`).
The output's shards, index and side files: `writing`; the proof: `verifying`.

Everything is written into a hidden temporary folder next to --output and renamed at the end: a
crash, a full disk or a failed verification never leaves a folder that looks complete.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch
from peft import PeftModel
from transformers.utils import logging as hf_logging

from lora_tune.after.merge.applying import TensorMerger
from lora_tune.after.merge.reading import OTHER_TYPES, NotStreamable, base_folder, disk_adapter, latest_adapter, named_adapter, read_adapter
from lora_tune.after.merge.verifying import FULL_CHECK_MAX_PARAMS, TOLERANCE, all_finite, relative_drift, verify_logits, verify_vision
from lora_tune.after.merge.writing import plan_output, prepare_output, shard_names, write_index, write_shard, write_side_files
from lora_tune.after.options import MergeConfig
from lora_tune.after.outputs import check_output, write_mark
from lora_tune.errors import UserError, sigterm_stops
from lora_tune.files import remove_tree
from lora_tune.models import shards
from lora_tune.models.adapter import peft_building
from lora_tune.models.loading import dequantizing, load_config, quant_method
from lora_tune.models.structure import auto_class, text_ids
from lora_tune.options import parse_size

log = logging.getLogger("lora_tune")

OUT_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def merge_whole_model(base: Path, adapter_dir: Path, out: Path, cfg: MergeConfig) -> float | None:
    """Through transformers and peft, the whole model in host memory: for a checkpoint that ships
    quantized weights (dequantized by transformers' own loader; written out plain, in --dtype),
    and for a model transformers doesn't implement (remote code) whose adapter adapts fused tensors,
    where no skeleton says which disk tensors they are built from. save_pretrained writes the
    checkpoint's own layout. Checked on the spot: logits of base + adapter vs the merged model.
    Returns the drift."""
    hf_logging.disable_progress_bar()
    dtype = OUT_DTYPE[cfg.dtype]
    config = load_config(str(base), cfg.trust_remote_code)
    model = auto_class(config).from_pretrained(
        base, dtype=dtype, trust_remote_code=cfg.trust_remote_code, quantization_config=dequantizing(config)
    )
    with peft_building():
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = text_ids(model, (2, 24), seed=0)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        merged = model.merge_and_unload()
        got = merged(input_ids=ids, use_cache=False).logits
    for name, p in merged.named_parameters():
        if p.is_floating_point() and not all_finite(p.data):
            raise UserError(f"merged weight {name} contains NaN/inf; the adapter is broken (check the training metrics)")
    merged.save_pretrained(out, max_shard_size=cfg.max_shard_size)
    drift = relative_drift(got, want)
    log.info("verify: whole-model logits, base + adapter (peft) vs merged: relative drift %.2e", drift)
    if cfg.verify and sum(p.numel() for p in merged.parameters()) <= FULL_CHECK_MAX_PARAMS:
        # What was written, read back: save_pretrained's layout must load as the model it saved.
        del model, merged
        reloaded = auto_class(config).from_pretrained(out, dtype=dtype, trust_remote_code=cfg.trust_remote_code).eval()
        with torch.no_grad():
            drift = max(drift, relative_drift(reloaded(input_ids=ids, use_cache=False).logits, want))
        log.info("verify: the written folder read back vs base + adapter (peft): relative drift %.2e", drift)
    return drift if cfg.verify else None


def run(cfg: MergeConfig) -> Path:
    given = Path(cfg.adapter).expanduser()
    max_bytes = parse_size(cfg.max_shard_size, "--max-shard-size")
    out = check_output(cfg.output, "merge", folder=True, overwrite=cfg.overwrite, inputs={"adapter": given})
    adapter_dir = latest_adapter(given)
    config, weights = read_adapter(adapter_dir)
    base_ref = cfg.base or config.get("base_model_name_or_path")
    if not base_ref:
        raise UserError(f"--base: {adapter_dir}/adapter_config.json records no base; pass --base")
    base = base_folder(base_ref)
    check_output(out, "merge", folder=True, overwrite=cfg.overwrite, inputs={"adapter": given, "base model": base})
    prepare_output(out)
    dtype = OUT_DTYPE[cfg.dtype]
    base_files = shards.weight_files(base)

    def through_transformers(reason: str, n_bytes: int) -> Path:
        """The whole-model route (transformers + peft, verified), said with its memory."""
        log.warning("merge: %s; merging through transformers with the whole model in host memory (~%.1f GB)", reason, n_bytes / 1e9)
        return finish(out, lambda tmp: merge_whole_model(base, adapter_dir, tmp, cfg), base, adapter_dir, cfg)

    if config.get("peft_type") in OTHER_TYPES:
        stored = sum(e.nbytes for f in base_files for e in shards.read_header(f).values())
        reason = f"a {config['peft_type']} adapter is not a LoRA pair per weight, which the streaming merge folds in; peft merges it"
        return through_transformers(reason, stored)
    quantized = quant_method(load_config(str(base), cfg.trust_remote_code))
    if quantized:
        stored = sum(e.nbytes for f in base_files for e in shards.read_header(f).values())
        reason = f"{base} ships {quantized}-quantized weights, which transformers dequantizes (more than stored) into plain {cfg.dtype}"
        return through_transformers(reason, stored)
    groups = plan_output(base_files, dtype, max_bytes)
    sources = {t.name: t.source for group in groups for t in group}
    output_bytes = sum(math.prod(t.shape) for group in groups for t in group) * dtype.itemsize
    try:
        adapter = disk_adapter(base, adapter_dir, config, weights, sources, cfg.trust_remote_code)
    except NotStreamable as e:
        return through_transformers(f"{e}, so transformers writes the checkpoint's own layout", output_bytes)
    if adapter is None and config.get("target_parameters"):
        reason = (
            f"the adapter adapts {', '.join(config['target_parameters'])} of a model transformers doesn't implement (remote code), "
            "so which tensors on disk they are built from is unknown"
        )
        return through_transformers(reason, output_bytes)
    if adapter is None:
        adapter = named_adapter(config, weights)
        missing = sorted((set(adapter.modules) | set(adapter.replacements)) - set(sources))
        if missing:
            raise UserError(
                f"--base: the adapter targets {missing[0]} (and {len(missing) - 1} more) which the base does not have; this "
                "adapter was trained on another base"
            )
    n_loras = len(adapter.modules) + len(adapter.fused)

    def stream(tmp: Path) -> float | None:
        t0 = time.perf_counter()
        merger = TensorMerger(adapter, dtype, cfg.verify, sources)
        names = shard_names(len(groups))
        for group, name in zip(groups, names):
            write_shard(tmp / name, group, merger)
        merger.close()
        write_index(tmp, groups, names)
        total = sum(t.nbytes for group in groups for t in group)
        log.info("wrote %d shard(s), %.2f GB, %d LoRA modules merged in %.1fs", len(names), total / 1e9, n_loras, time.perf_counter() - t0)
        if not cfg.verify:
            return None
        drift = max(merger.layer_drifts, default=0.0)
        log.info("verify: %d sampled layers vs the unmerged LoRA forward: max relative drift %.2e", len(merger.layer_drifts), drift)
        if sum(math.prod(t.shape) for group in groups for t in group) <= FULL_CHECK_MAX_PARAMS:
            logits_drift = verify_logits(base, adapter_dir, tmp, cfg.trust_remote_code)
            log.info("verify: whole-model logits vs base + adapter (peft): relative drift %.2e", logits_drift)
            drift = max(drift, logits_drift)
        return drift

    return finish(out, stream, base, adapter_dir, cfg)


def finish(out: Path, write, base: Path, adapter_dir: Path, cfg: MergeConfig) -> Path:
    """Run `write(tmp)` (-> drift, or None when not verified) into a hidden temporary folder, add
    the side files, check the drift, and only then put the folder in place."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    with sigterm_stops(f"merging into {out}", "nothing was written. Run the same command again") as stop:
        return _finish(out, tmp, write, base, adapter_dir, cfg, stop.check)


def _finish(out: Path, tmp: Path, write, base: Path, adapter_dir: Path, cfg: MergeConfig, before_commit) -> Path:
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    try:
        write_side_files(base, adapter_dir, tmp, cfg.dtype)  # first: verification loads the folder
        drift = write(tmp)
        compared = verify_vision(base, tmp, adapter_dir) if cfg.verify else None
        if compared is not None:
            log.info("verify: %d vision tower / projector tensors bit-identical to the base's", compared)
        if drift is not None:
            tolerance = TOLERANCE[cfg.dtype]
            if not drift <= tolerance:
                raise UserError(
                    f"verification failed: merged model drifts {drift:.2e} from base + adapter (tolerance {tolerance:.0e}); "
                    "nothing was written"
                )
            log.info("verified: drift %.2e within tolerance %.0e for %s", drift, tolerance, cfg.dtype)
        write_mark(tmp, "merge", adapter=adapter_dir, base=base, dtype=cfg.dtype)  # a later --overwrite may replace it
        before_commit()  # a SIGTERM that came while merging stops it here, before anything is in place
        if out.exists():  # --overwrite: swap, so the old folder is only gone once the new one is in place
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            remove_tree(old)
        else:
            os.replace(tmp, out)
    except OSError as e:
        remove_tree(tmp)
        raise UserError(
            f"--output: could not write the merged model under {out.parent} ({e.strerror or e}); nothing was left behind. Free "
            "space or choose another --output",
            exit_code=1,
        ) from None
    except BaseException:
        remove_tree(tmp)
        raise
    log.info("merged model written to %s", out)
    return out
