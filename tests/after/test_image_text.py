"""Image-text checkpoints after training: `merge` writes a folder that loads with AutoProcessor and
AutoModelForImageTextToText, equals base + adapter on an image, and keeps the vision tower and
projector bit for bit; `export --format gguf` says in one line that the vision projector (mmproj) is
not written; `check-serving` knows vLLM's and llama.cpp's image-text rules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from lora_tune.after.merge import applying
from lora_tune.after.serving import check_config
from lora_tune.after.vision import PROCESSOR_FILES
from lora_tune.cli import main
from lora_tune.config import TrainConfig
from lora_tune.errors import UserError
from lora_tune.models.targets import Targets
from lora_tune.models.tiny.vision import build_tiny_image_text_model

from helpers import TEXT, fast_train_args, run_cli, single_error_line, write_jsonl

FAMILIES = ("gemma3", "llava")
VISION = ("vision_tower.", "multi_modal_projector.")  # the tiny checkpoints' disk names outside the language model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Per family: the tiny base, an adapter trained through the CLI (text rows: it adapts the language
    model only), and the fp32 merge of the two."""
    root = tmp_path_factory.mktemp("image-text")
    data = write_jsonl(root / "text.jsonl", TEXT)
    out = {}
    for family in FAMILIES:
        base = build_tiny_image_text_model(family, root / family)
        run = root / f"run-{family}"
        # A high learning rate so the adapter moves far from identity and a wrong merge shows.
        args = fast_train_args(base, data, run, max_steps=2, lr=5e-2)
        assert run_cli_ok(args)
        merged = root / f"merged-{family}"
        assert run_cli_ok(["merge", "--adapter", run, "--output", merged, "--dtype", "fp32"])
        out[family] = (base, run, merged)
    return out


def run_cli_ok(args) -> bool:
    return main([str(a) for a in args]) == 0


def image_inputs(processor) -> dict:
    """An image drawn on the spot and a user turn that shows it, rendered by the processor's chat template."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert processor.image_token in text or "<start_of_image>" in text
    return processor(text=[text], images=[Image.new("RGB", (64, 64), (200, 10, 10))], return_tensors="pt")


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_folder_loads_with_its_processor_and_equals_base_plus_adapter_on_an_image(family, world):
    base, run, merged = world[family]
    for name in PROCESSOR_FILES:  # every processor file the base has, copied as a plain file
        if (base / name).exists():
            assert not (merged / name).is_symlink() and (merged / name).read_bytes() == (base / name).read_bytes(), name
    assert (merged / "processor_config.json").is_file()
    processor = AutoProcessor.from_pretrained(merged)
    assert type(processor) is type(AutoProcessor.from_pretrained(base))
    inputs = image_inputs(processor)
    assert "pixel_values" in inputs
    want = logits(PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), run), inputs)
    got = logits(AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32), inputs)
    base_only = logits(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), inputs)
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 1e-5
    assert (base_only - want).abs().max() / scale > 1e-3, "the adapter must change the function, or the test proves nothing"
    before, after = load_file(base / "model.safetensors"), load_file(merged / "model.safetensors")
    vision = [k for k in before if k.startswith(VISION)]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)


def test_a_train_vision_adapter_merges_into_the_tower_and_projector(world, tmp_path, capsys):
    """--train-vision: the merged tower and projector carry the adapter (== base + adapter on an image),
    and only the tensors it leaves alone are verified bit for bit."""
    base = world["llava"][0]
    Image.new("RGB", (40, 40), (10, 200, 10)).save(tmp_path / "green.png")
    rows = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "green.png"}, {"type": "text", "text": "Colour?"}]},
                {"role": "assistant", "content": "Green."},
            ]
        }
    ] * 4
    run, merged = tmp_path / "run", tmp_path / "merged"
    code, _, err = run_cli(
        fast_train_args(base, write_jsonl(tmp_path / "d.jsonl", rows), run, max_steps=2, lr=5e-2, train_vision=True), capsys
    )
    assert code == 0, err
    code, _, err = run_cli(["merge", "--adapter", run, "--output", merged, "--dtype", "fp32"], capsys)
    assert code == 0, err
    inputs = image_inputs(AutoProcessor.from_pretrained(merged))
    want = logits(PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), run), inputs)
    got = logits(AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32), inputs)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    before, after = load_file(base / "model.safetensors"), load_file(merged / "model.safetensors")
    vision = [k for k in before if k.startswith(VISION)]
    changed = {k for k in vision if not torch.equal(before[k], after[k])}
    linears = {k for k in vision if k.endswith(".weight") and before[k].dim() == 2 and "embed" not in k}
    assert changed == linears  # every linear of the tower and the projector, nothing else
    untouched = [k for k in vision if f"{k.rsplit('.', 1)[0]}.weight" not in linears]  # an adapted linear's bias: skipped
    assert f"verify: {len(untouched)} vision tower / projector tensors bit-identical to the base's" in err


def test_merge_verifies_the_vision_tower_bit_for_bit_in_any_dtype(world, tmp_path, capsys):
    base, run, _ = world["llava"]
    code, _, err = run_cli(["merge", "--adapter", run, "--output", tmp_path / "bf16", "--dtype", "bf16"], capsys)
    assert code == 0, err
    n = sum(k.startswith(VISION) for k in load_file(base / "model.safetensors"))
    assert f"verify: {n} vision tower / projector tensors bit-identical to the base's" in err


def test_a_vision_tensor_changed_by_the_merge_fails_verification(world, tmp_path, capsys, monkeypatch):
    base, run, _ = world["gemma3"]
    produce = applying.TensorMerger.__call__

    def nudged(self, t):
        tensor = produce(self, t)
        return tensor + 1e-3 if t.name.startswith("vision_tower.") and t.name.endswith("q_proj.weight") else tensor

    monkeypatch.setattr(applying.TensorMerger, "__call__", nudged)
    out = tmp_path / "merged"
    code, _, err = run_cli(["merge", "--adapter", run, "--output", out, "--dtype", "fp32"], capsys)
    line = single_error_line(err)
    assert code == 2 and line.startswith("error: verification failed: vision_tower.") and "nothing was written" in line
    assert not out.exists()


def test_processor_files_are_read_through_links_validated_and_written_plain(world, tmp_path, capsys):
    base, run, _ = world["gemma3"]
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    elsewhere = tmp_path / "elsewhere" / "processor_config.json"  # a hub cache: the file is a link to a blob
    elsewhere.parent.mkdir()
    shutil.move(copy / "processor_config.json", elsewhere)
    (copy / "processor_config.json").symlink_to(elsewhere)
    video = {"video_processor_type": "ExampleVideoProcessor", "size": {"height": 64, "width": 64}}
    (copy / "video_preprocessor_config.json").write_text(json.dumps(video))
    out = tmp_path / "merged"
    code, _, err = run_cli(["merge", "--adapter", run, "--base", copy, "--output", out, "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert not (out / "processor_config.json").is_symlink() and (out / "processor_config.json").read_bytes() == elsewhere.read_bytes()
    assert json.loads((out / "video_preprocessor_config.json").read_text()) == video
    for fault in (b"", b'{"image_processor": ', b"[1, 2]"):
        elsewhere.write_bytes(fault)
        code, _, err = run_cli(["merge", "--adapter", run, "--base", copy, "--output", tmp_path / "again", "--dtype", "fp32"], capsys)
        line = single_error_line(err)
        assert code == 2 and f"--base: {copy}/processor_config.json is unreadable or not a processor's JSON" in line
    elsewhere.write_bytes((base / "processor_config.json").read_bytes())
    # A run whose tokenizer has no chat template file: the base's template (here a processor's own
    # chat_template.json) goes with the processor.
    bare_run = tmp_path / "run"
    shutil.copytree(run, bare_run)
    (bare_run / "chat_template.jinja").unlink()
    template = (base / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").unlink()
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    out = tmp_path / "templated"
    code, _, err = run_cli(["merge", "--adapter", bare_run, "--base", copy, "--output", out, "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert AutoProcessor.from_pretrained(out).chat_template == template
    elsewhere.unlink()  # a dangling link
    code, _, err = run_cli(["merge", "--adapter", run, "--base", copy, "--output", tmp_path / "again", "--dtype", "fp32"], capsys)
    assert code == 2 and "processor_config.json is unreadable" in single_error_line(err)
    assert not (tmp_path / "again").exists()


# --- export --------------------------------------------------------------------------------------------
def test_gguf_export_writes_the_language_model_and_says_the_mmproj_is_not_written(world, tmp_path, capsys):
    pytest.importorskip("gguf", reason="the gguf package is an optional extra (lora-tune[export])")
    _, run, merged = world["llava"]
    for source, where in ((run, "the base's own mmproj GGUF fits"), (merged, f"convert_hf_to_gguf.py --mmproj on {merged}")):
        out = tmp_path / f"{source.name}.gguf"
        code, _, err = run_cli(["export", source, "--format", "gguf", "--output", out], capsys)
        assert code == 0, err
        (line,) = [x for x in err.splitlines() if "mmproj" in x]
        assert line.startswith(f"export: llava is an image-text model: {out.name} holds its language model (llama) only")
        assert "are not written" in line and where in line
        assert "verify: logits through transformers' GGUF loader" in err  # the language model read back and compared
    code, _, err = run_cli(["export", world["gemma3"][2], "--format", "gguf", "--output", tmp_path / "g.gguf"], capsys)
    line = single_error_line(err)
    assert code == 2 and "gemma3 is an image-text model" in line and "mmproj" in line and "gemma3_text" in line
    assert not (tmp_path / "g.gguf").exists()


# --- check-serving -------------------------------------------------------------------------------------
def adapter_on(folder: Path, base: Path, modules: list[str]) -> Path:
    """A LoRA adapter folder whose tensors adapt `modules` (the rules read names, never the model)."""
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "base_model_name_or_path": str(base)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {f"base_model.model.{m}.lora_{p}.weight": torch.zeros(4, 4) for m in modules for p in "AB"}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


LANGUAGE = "model.language_model.layers.0.self_attn.q_proj"
TOWER = "model.vision_tower.encoder.layers.0.self_attn.q_proj"
PROJECTOR = "model.multi_modal_projector.linear_1"


def test_vllm_and_llama_cpp_refuse_lora_on_the_vision_tower_or_projector(world, tmp_path, capsys):
    base = world["llava"][0]
    for i, modules in enumerate(([LANGUAGE, TOWER], [LANGUAGE, PROJECTOR])):
        adapter = adapter_on(tmp_path / f"a{i}", base, modules)
        code, _, err = run_cli(["check-serving", adapter, "--engine", "vllm"], capsys)
        line = single_error_line(err)
        assert code == 2 and "language model only" in line and modules[1] in line and "merge (`lora-tune merge`)" in line
        code, _, err = run_cli(["check-serving", adapter, "--engine", "llama.cpp"], capsys)
        assert code == 2 and "never to the vision projector (mmproj)" in single_error_line(err)
    # The language model alone serves, also under an older checkpoint layout's names (not the tower's).
    for i, module in enumerate((LANGUAGE, "language_model.model.layers.0.self_attn.q_proj")):
        code, out, err = run_cli(["check-serving", adapter_on(tmp_path / f"lm{i}", base, [module]), "--engine", "vllm"], capsys)
        assert code == 0 and "this adapter serves" in out, err
    code, out, err = run_cli(["check-serving", world["gemma3"][1], "--engine", "vllm"], capsys)  # a trained run
    assert code == 0 and "this adapter serves" in out, err


def test_serve_with_vllm_refuses_train_vision_on_an_image_text_model(world):
    base = world["gemma3"][0]
    targets = Targets(("q_proj", "v_proj"))
    cfg = TrainConfig(base=str(base), data=["x.jsonl"], output_dir="out", serve_with="vllm", train_vision=True)
    with pytest.raises(UserError) as raised:
        check_config(cfg, targets, "gemma3")
    assert str(raised.value).startswith("--serve-with vllm: ") and "drop --train-vision" in str(raised.value)
    check_config(cfg, targets, "llama")  # a text model has no vision tower: nothing to refuse
    check_config(cfg.model_copy(update={"train_vision": False}), targets, "gemma3")


def test_a_merged_folder_needs_its_processor_files_for_vllm(world, tmp_path, capsys):
    code, out, err = run_cli(["check-serving", world["gemma3"][2], "--engine", "vllm"], capsys)
    assert code == 0 and f"serve it with: vllm serve {world['gemma3'][2]}" in out, err
    merged = tmp_path / "merged"
    shutil.copytree(world["gemma3"][2], merged)
    (merged / "processor_config.json").unlink()
    code, _, err = run_cli(["check-serving", merged, "--engine", "vllm"], capsys)
    assert code == 2 and "has no processor_config.json or preprocessor_config.json" in single_error_line(err)
    (merged / "processor_config.json").write_text("{not json")
    code, _, err = run_cli(["check-serving", merged, "--engine", "vllm"], capsys)
    assert code == 2 and "processor_config.json is unreadable" in single_error_line(err)
    code, _, err = run_cli(["check-serving", world["gemma3"][2], "--engine", "llama.cpp"], capsys)
    assert code == 2 and "gemma3_text language models have no GGUF export" in single_error_line(err)
    code, out, err = run_cli(["check-serving", world["llava"][2], "--engine", "llama.cpp"], capsys)
    assert code == 0 and "--format gguf" in out and "mmproj" in out, err
