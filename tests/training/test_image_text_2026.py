"""Image-text training on a 2026 family, Qwen3.5 (`qwen3_5`: a hybrid gated-delta-net / attention
decoder, interleaved multimodal rotary positions, `mm_token_type_ids`): the loss lora-tune trains
equals the model's own, with and without images, and a training run reaches the image and adapts
only the language model.

Its processor needs torchvision (the video processor); where torchvision can't be imported (this
machine's CPU build of torch has no working wheel) the module is skipped."""

from __future__ import annotations

import pytest

try:
    import torchvision  # noqa: F401 - Qwen3.5's processor needs it
except Exception as e:  # ImportError, or torchvision's operators failing to register on this torch
    pytest.skip(f"torchvision can't be imported ({type(e).__name__}: {str(e).splitlines()[0][:120]})", allow_module_level=True)

import torch
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import AutoModelForImageTextToText

from lora_tune.data.batching import collate
from lora_tune.data.prepare import Sample
from lora_tune.data.tokenize import Tokenize
from lora_tune.models.loading import load_config, load_tokenizer
from lora_tune.models.processors import load_image_text
from lora_tune.models.tiny.vision import build_tiny_image_text_model
from lora_tune.training.objectives.sft import CausalLMLoss

from helpers import adapter_tensors, data_config, fast_train_args, read_metrics, run_cli, write_jsonl

FAMILY = "qwen3_5"
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}
LANGUAGE_QV = r".*language_model.*\.(q_proj|v_proj)"
WITH_TOWER = r".*\.(q_proj|v_proj|qkv|linear_fc1)"  # + the tower's fused qkv and MLP, the merger's first linear


def row(colour: str, image: str | None = None) -> dict:
    user = [{"type": "text", "text": "What colour is this?"}]
    if image:
        user.insert(0, {"type": "image", "image": image})
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"It is {colour}."}]}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("image_text_2026")
    (root / "img").mkdir()
    for name, colour in COLOURS.items():
        Image.new("RGB", (64, 48), colour).save(root / "img" / f"{name}.png")
        Image.new("RGB", (48, 64), tuple(255 - c for c in colour)).save(root / "img" / f"other-{name}.png")
    return {"root": root, "base": build_tiny_image_text_model(FAMILY, root / FAMILY)}


def micro_batch(base, folder, rows: list[dict]):
    """The rows as lora-tune collates them (images, blank image where none), and as text alone."""
    cfg = data_config()
    image_text = load_image_text(str(base), load_config(str(base), False), cfg)
    assert not isinstance(image_text, str), image_text
    out = Tokenize(load_tokenizer(str(base), False), "messages", cfg, "d.jsonl", image_text=image_text, folder=folder)(
        {"messages": [r["messages"] for r in rows]}, list(range(len(rows)))
    )
    samples = [Sample(out["input_ids"][i], out["labels"][i], out["starts"][i], images=out["images"][i]) for i in range(len(rows))]
    return collate([[s] for s in samples], 0, packed=False, image_text=image_text), collate([[s] for s in samples], 0, packed=False)


def adapted(base, targets: str):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


def lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def test_the_processor_is_the_familys_own_and_an_image_is_a_few_tokens(world):
    image_text = load_image_text(str(world["base"]), load_config(str(world["base"]), False), data_config())
    assert type(image_text.processor).__name__ == "Qwen3VLProcessor"
    assert image_text.placeholder == "<|image_pad|>" and image_text.token_types == ["mm_token_type_ids"]
    assert image_text.packing_refusal == "qwen3_5 computes multimodal rotary positions over the whole sequence"
    ids = image_text.expand("<|vision_start|><|image_pad|><|vision_end|>Hi", [Image.open(world["root"] / "img/red.png")])
    assert ids.count(image_text.image_token_id) == 4


@pytest.mark.parametrize("vision", [False, True], ids=["language-model", "with-tower"])
def test_the_trained_loss_equals_the_models_own_with_and_without_images(world, vision):
    base, folder = world["base"], world["root"]
    model = adapted(base, WITH_TOWER if vision else LANGUAGE_QV)
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
