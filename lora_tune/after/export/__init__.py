"""`lora-tune export`: a run or a merged folder as a GGUF file (llama.cpp, LM Studio), a llama.cpp LoRA
adapter, or an Ollama folder (GGUF + Modelfile); read back and verified before it is put in place.

The source is read as `merge` reads it: from a run, each tensor of the full-precision base is merged
with the adapter in fp32 (lora_tune.after.merge's TensorMerger) and handed to the writer one at a time;
from a merged folder, tensors are read shard by shard. Either way nothing holds the whole model.

Everything goes into a hidden temporary folder next to --output; the file is verified there and only
then renamed into place, so a crash or a failed check leaves nothing that looks complete.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from lora_tune.after.export import gguf as gguf_format
from lora_tune.after.export import gguf_check, gguf_lora, image_text, ollama
from lora_tune.after.export.files import Source, check_format, is_gguf, open_source, put_in_place, staged
from lora_tune.after.options import ExportConfig
from lora_tune.after.outputs import check_output, write_mark
from lora_tune.errors import UserError
from lora_tune.files import writable_folder

log = logging.getLogger("lora_tune")


def run(cfg: ExportConfig):
    """Export; returns the verification figures (`gguf.RoundTrip`) with `.path` set."""
    try:
        import gguf  # noqa: F401, PLC0415 - optional dependency (the [export] extra)
    except ImportError:
        raise UserError('export: the gguf package is missing; pip install "lora-tune[export]" (or pip install gguf)') from None
    out = Path(cfg.output).expanduser()
    check_format(out, cfg.format)
    source = open_source(cfg)
    try:  # what export reads is never written, held or written into
        inputs = {"source": Path(cfg.source).expanduser(), **({"base model": source.base} if source.base else {})}
        check_output(out, "export", folder=cfg.format == "ollama", overwrite=cfg.overwrite, inputs=inputs, ours=is_gguf)
        writable_folder(out if cfg.format == "ollama" else out.parent, "--output")
    except UserError:
        source.close()
        raise
    if cfg.format == "gguf-lora":
        return gguf_lora.run(cfg, source, out)
    if source.produce is None:
        raise UserError(
            f"--format {cfg.format}: the adapter adapts fused tensors ({', '.join(source.adapter_config['target_parameters'])}); "
            "merge first (`lora-tune merge`), then serve the merged folder with vLLM or transformers"
        )
    model = image_text.exported(source, cfg.format, out)  # an image-text model: its language model (said in one line)
    family, by_name = model.family, source.by_name
    planned = gguf_format.plan_tensors(model.config, family, [(n, by_name[d].shape) for n, d in model.names.items()], cfg.quant)
    name = f"{source.config.get('model_type', 'model')}-{source.folder.name}"
    if family.general_name_hint and family.general_name_hint not in name.lower():
        name = f"{family.general_name_hint}-{name}"
    with staged(out) as tmp:
        gguf_path = tmp / "model.gguf"
        t0 = time.perf_counter()
        gguf_format.write(
            gguf_path,
            model.config,
            family,
            planned,
            lambda t: source.produce(by_name[model.names[t.hf_name]]).float(),
            source.tokenizer_dir,
            cfg.quant,
            name,
        )
        source.close()
        seconds = time.perf_counter() - t0
        log.info("wrote %s: %d tensors, %.2f GB (%s) in %.1fs", out.name, len(planned), gguf_path.stat().st_size / 1e9, cfg.quant, seconds)
        result = (
            verify(gguf_path, source, model.config, family, planned, cfg)
            if cfg.verify
            else gguf_check.RoundTrip(len(planned), notes=["not verified (--no-verify)"])
        )
        result.seconds = seconds
        result.notes[:0] = model.notes
        if cfg.format == "ollama":
            ollama.write_modelfile(tmp, source.tokenizer_dir, model.config, "model.gguf")
            if cfg.verify:
                ollama.check_modelfile(tmp / "Modelfile", source.tokenizer_dir)
            write_mark(tmp, "export", format=cfg.format, source=source.folder, quant=cfg.quant)  # a later --overwrite may replace it
            put_in_place(tmp, out)
        else:
            put_in_place(gguf_path, out)
        result.path = out
    log.info("exported %s to %s", cfg.format, out)
    return result


def verify(path: Path, source: Source, config: dict, family, planned, cfg: ExportConfig):
    """Read back (tensors, shapes, metadata), tokenizer ids, and - up to 100M parameters - logits of
    transformers' GGUF loader vs the merged model on fixed prompts. `config`: the exported model's
    (an image-text model's language model: its text config; the logits are the whole model's on text)."""
    gguf_check.check_file(path, planned, config, family)
    result = gguf_check.RoundTrip(len(planned))
    result.token_ids_equal = gguf_check.check_tokenizer(path, source.tokenizer_dir)
    if not result.token_ids_equal:
        raise UserError(
            "verification failed: the tokenizer rebuilt from the GGUF encodes the fixed text to other ids (or other BOS/EOS/chat template) "
            "than the original; nothing was kept",
            exit_code=1,
        )
    if source.n_params > gguf_check.FULL_CHECK_MAX_PARAMS:
        result.notes.append(
            f"logits not compared: {source.n_params / 1e9:.1f}B parameters (the check holds two models in RAM up to "
            f"{gguf_check.FULL_CHECK_MAX_PARAMS / 1e6:.0f}M)"
        )
        log.info("verify: %s", result.notes[-1])
        return result
    ids = gguf_check.fixed_prompts(source.tokenizer_dir, config["vocab_size"])
    want = source.reference(ids)
    reading, filled = gguf_check.reading_config(path, config)
    if filled:
        result.notes.append(
            f"transformers' GGUF reader has no key for {', '.join(filled)} on this architecture: taken from the source for the logits check"
        )
        log.info("verify: %s", result.notes[-1])
    got = gguf_check.gguf_logits(path, ids, reading)
    gguf_check.compare(got, want, cfg.quant, result)
    confident = (
        f" ({100 * result.confident_agreement:.2f}% at the {result.confident_positions} positions where the merged model is confident)"
        if result.confident_positions
        else ""
    )
    log.info(
        "verify: logits through transformers' GGUF loader vs the merged model: max diff %.2e (relative %.2e), greedy "
        "agreement %.2f%%%s, tokenizer ids equal",
        result.max_abs_logit_diff,
        result.max_rel_logit_diff,
        100 * result.greedy_agreement,
        confident,
    )
    return result
