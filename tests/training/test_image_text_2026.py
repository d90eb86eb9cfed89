"""Image-text training on a 2026 family, Qwen3.5 (`qwen3_5`: a hybrid gated-delta-net / attention
decoder, interleaved multimodal rotary positions, `mm_token_type_ids`): the loss lora-tune trains
equals the model's own, with and without images, and a training run reaches the image and adapts
only the language model.

Its processor bundles a video processor that needs torchvision; where torchvision can't be imported
(this machine's CPU build of torch has no working wheel) the processor is built without it, as with
Qwen2-VL (tests/training/test_image_text_qwen_vl.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

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
    lora_grads,
    micro_batch,
    read_metrics,
    row,
    run_cli,
    write_jsonl,
)

FAMILY = "qwen3_5"
WITH_TOWER = r".*\.(q_proj|v_proj|qkv|linear_fc1)"  # + the tower's fused qkv and MLP, the merger's first linear


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("image_text_2026")
    colour_images(root)
    return {"root": root, "base": build_tiny_image_text_model(FAMILY, root / FAMILY)}


def test_the_processor_is_the_familys_own_and_an_image_is_a_few_tokens(world):
    image_text = load_image_text_of(world["base"])
    assert type(image_text.processor).__name__ == "Qwen3VLProcessor"
    assert image_text.placeholder == "<|image_pad|>" and image_text.token_types == ["mm_token_type_ids"]
    assert image_text.packing_refusal == "qwen3_5 computes multimodal rotary positions over the whole sequence"
    ids = image_text.expand("<|vision_start|><|image_pad|><|vision_end|>Hi", [Image.open(world["root"] / "img/red.png")])
    assert ids.count(image_text.image_token_id) == 4


@pytest.mark.parametrize("vision", [False, True], ids=["language-model", "with-tower"])
def test_the_trained_loss_equals_the_models_own_with_and_without_images(world, vision):
    base, folder = world["base"], world["root"]
    model = adapted_image_text_model(base, WITH_TOWER if vision else LANGUAGE_QV)
    for rows in ([row("red", "img/red.png"), row("blue", "img/other-blue.png"), row("green")], [row("green"), row("red")]):
        batch, text_only = micro_batch(base, folder, rows)
        inputs = dict(batch.inputs)
        ours = CausalLMLoss(model, None)(**inputs, num_items_in_batch=batch.label_tokens)
        ours.backward()
        ours_grads = lora_grads(model)
        images = any(r["messages"][0]["content"][0]["type"] == "image" for r in rows)
        if images:
            assert inputs["mm_token_type_ids"].any() and "image_grid_thw" in inputs
        else:
            # No image in the micro-batch: ours carries a blank one that nothing attends to; the
            # model's own forward takes the text alone.
            assert inputs["input_ids"].shape[1] > text_only.inputs["input_ids"].shape[1]
            inputs = text_only.inputs
        theirs = model(**inputs).loss
        theirs.backward()
        theirs_grads = lora_grads(model)
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
        # The blank image reaches the tower's LoRA (with-tower) with exactly zero gradient.
        blank = {n for n in ours_grads.keys() - theirs_grads.keys() if not ours_grads[n].any()}
        assert ours_grads.keys() - blank == theirs_grads.keys() and theirs_grads
        assert bool(blank) == (vision and not images)
        for name, g in theirs_grads.items():
            assert torch.allclose(ours_grads[name], g, rtol=1e-4, atol=1e-7), name
        assert not any(p.grad is not None for n, p in model.named_parameters() if "lora" not in n)
        if vision and images:  # the tower's and the merger's LoRA reached
            assert any(".visual.blocks." in n for n in theirs_grads) and any(".visual.merger." in n for n in theirs_grads)


def test_training_reaches_the_image_and_never_adapts_the_vision_tower(world, capsys):
    root, base = world["root"], world["base"]
    names = list(COLOURS) * 2
    runs = {"images": [row(c, f"img/{c}.png") for c in names], "other-images": [row(c, f"img/other-{c}.png") for c in names]}
    losses, adapters = {}, {}
    for name, rows in runs.items():
        data = write_jsonl(root / f"{name}.jsonl", rows)
        code, out, err = run_cli(fast_train_args(base, data, root / f"out-{name}", max_steps=2, data_cache=False), capsys)
        assert code == 0, err
        # Its gated-delta-net layers carry state from one packed sample into the next: padded batches.
        assert "packing off: Qwen3_5ForConditionalGeneration lets packed samples see each other" in out + err
        assert "images: 6 of 6 training" in out + err
        losses[name] = [m["loss"] for m in read_metrics(root / f"out-{name}") if "loss" in m]
        adapters[name] = adapter_tensors(root / f"out-{name}")
    assert len(losses["images"]) == 2 and losses["images"][0] != losses["other-images"][0]
    assert adapters["images"].keys() == adapters["other-images"].keys()
    keys = list(adapters["images"])
    assert keys and all("language_model" in k for k in keys)
    assert not any(part in k for k in keys for part in ("visual", "merger", "vision"))
