"""Qwen2-VL and Qwen2.5-VL where torchvision can't be imported (this machine: no torchvision build
loads against its CPU torch). Their processors bundle a video processor that needs torchvision, so
lora-tune builds the processor from the image processor (PIL/numpy) and the tokenizer: images train
as usual, from typed parts and from `<image>` placeholders; a video part is refused in one line; the
merged folder carries the processor files unchanged, loads with that processor, and equals base +
adapter on an image."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from lora_tune.after.vision import PROCESSOR_FILES
from lora_tune.models.tiny.vision import build_tiny_image_text_model
from lora_tune.training.objectives.sft import CausalLMLoss

from helpers import (
    COLOURS,
    LANGUAGE_QV,
    adapted_image_text_model,
    adapter_tensors,
    colour_images,
    fast_train_args,
    load_image_text_of,
    micro_batch,
    read_metrics,
    row,
    run_cli,
    single_error_line,
    write_jsonl,
)

PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # what the family's chat template writes for an image


def torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401, PLC0415 - whether this machine has a working one is the question
    except Exception:  # noqa: BLE001 - ImportError, or its operators failing to register on this torch
        return False
    return True


def placeholder_row(colour: str) -> dict:
    """LLaMA-Factory's style: `<image>` in the text, the file in an `images` column."""
    return {
        "messages": [{"role": "user", "content": "<image>What colour is this?"}, {"role": "assistant", "content": f"It is {colour}."}],
        "images": [f"img/{colour}.png"],
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen_vl")
    colour_images(root)
    typed = write_jsonl(root / "typed.jsonl", [row(c, f"img/{c}.png") for c in COLOURS] * 2)
    placeholders = write_jsonl(root / "placeholders.jsonl", [placeholder_row(c) for c in COLOURS] * 2)
    return {
        "root": root,
        "bases": {family: build_tiny_image_text_model(family, root / family) for family in PROCESSORS},
        "data": [typed, placeholders],
    }


@pytest.mark.parametrize("family", list(PROCESSORS))
def test_the_processor_is_built_without_its_video_processor_and_trains_the_models_own_loss(family, world):
    base, folder = world["bases"][family], world["root"]
    if not torchvision_imports():  # what the family's own loading does here
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(base)
    image_text = load_image_text_of(base)
    assert type(image_text.processor).__name__ == PROCESSORS[family]
    assert image_text.pixel_keys[:2] == ["pixel_values", "image_grid_thw"] and image_text.token_types == ["mm_token_type_ids"]
    # 64 x 48 pixels resized to 56 x 56: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens.
    ids = image_text.expand(f"{IMAGE}Hi", [Image.open(folder / "img/red.png")])
    assert ids.count(image_text.image_token_id) == 4
    model = adapted_image_text_model(base, LANGUAGE_QV)
    batch, _ = micro_batch(base, folder, [row("red", "img/red.png"), row("blue", "img/other-blue.png")])
    ours = CausalLMLoss(model, None)(**batch.inputs, num_items_in_batch=batch.label_tokens)
    theirs = model(**batch.inputs).loss
    assert abs(ours.item() - theirs.item()) < 1e-5 * abs(theirs.item())


@pytest.mark.parametrize("family", list(PROCESSORS))
def test_typed_and_placeholder_rows_train_and_the_merge_loads_with_its_processor(family, world, capsys):
    base, root = world["bases"][family], world["root"]
    run, merged = root / f"run-{family}", root / f"merged-{family}"
    # A high learning rate so the adapter moves far from identity and a wrong merge shows.
    code, out, err = run_cli(fast_train_args(base, world["data"], run, max_steps=2, lr=5e-2, data_cache=False), capsys)
    assert code == 0, err
    if not torchvision_imports():
        assert f"processor: {PROCESSORS[family]} without its video processor" in out + err
    assert "images: 12 of 12 training" in out + err
    losses = [m["loss"] for m in read_metrics(run) if "loss" in m]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert all("language_model" in k for k in adapter_tensors(run))
    code, _, err = run_cli(["merge", "--adapter", run, "--output", merged, "--dtype", "fp32"], capsys)
    assert code == 0 and "verified: drift" in err, err
    for name in PROCESSOR_FILES + ("chat_template.jinja",):
        assert (base / name).exists() == (merged / name).exists(), name
        if (base / name).exists():
            assert (merged / name).read_bytes() == (base / name).read_bytes(), name
    # The merged folder loads with its processor (built the same way here) and computes base + adapter.
    processor = load_image_text_of(merged).processor
    assert type(processor).__name__ == PROCESSORS[family]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (56, 56), (200, 10, 10))], return_tensors="pt")
    assert inputs["pixel_values"].shape[0] == 16

    def logits(model):
        with torch.no_grad():
            return model.eval()(**inputs).logits

    want = logits(PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), run))
    got = logits(AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32))
    base_only = logits(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32))
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 1e-5
    assert (base_only - want).abs().max() / scale > 1e-3, "the adapter must change the function, or the test proves nothing"


def test_a_video_part_is_refused_in_one_line(world, capsys, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}, {"role": "assistant", "content": "A cat."}]}
    ]
    data = write_jsonl(tmp_path / "video.jsonl", rows)
    code, _, err = run_cli(fast_train_args(world["bases"]["qwen2_vl"], data, tmp_path / "out"), capsys)
    assert code == 2 and "a content part of type 'video'; only text and image parts can be trained here" in single_error_line(err)
    assert not (tmp_path / "out").exists()
