"""Image-text training: the loss the engines train equals the model's own loss on the same inputs
(three families: multimodal rotary positions, token types + projector, a LLaVA projector), the
image reaches the loss, and the vision tower and projector stay frozen and unadapted."""

from __future__ import annotations

from pathlib import Path

import pytest
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
from lora_tune.notebook import show_samples
from lora_tune.training.objectives.sft import CausalLMLoss

from helpers import adapter_tensors, data_config, fast_train_args, read_metrics, run_cli, single_error_line, write_jsonl

FAMILIES = ("paddleocr_vl", "gemma3", "llava")
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


def row(colour: str, image: str | None = None) -> dict:
    user = [{"type": "text", "text": "What colour is this?"}]
    if image:
        user.insert(0, {"type": "image", "image": image})
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"It is {colour}."}]}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("image_text_training")
    (root / "img").mkdir()
    for name, colour in COLOURS.items():
        Image.new("RGB", (64, 48), colour).save(root / "img" / f"{name}.png")
        Image.new("RGB", (48, 64), tuple(255 - c for c in colour)).save(root / "img" / f"other-{name}.png")
    bases = {family: build_tiny_image_text_model(family, root / family) for family in FAMILIES}
    return {"root": root, "bases": bases}


def micro_batch(base: Path, folder: Path, rows: list[dict]):
    cfg = data_config()
    image_text = load_image_text(str(base), load_config(str(base), False), cfg)
    out = Tokenize(load_tokenizer(str(base), False), "messages", cfg, "d.jsonl", image_text=image_text, folder=folder)(
        {"messages": [r["messages"] for r in rows]}, list(range(len(rows)))
    )
    samples = [Sample(out["input_ids"][i], out["labels"][i], out["starts"][i], images=out["images"][i]) for i in range(len(rows))]
    return collate([[s] for s in samples], 0, packed=False, image_text=image_text), collate([[s] for s in samples], 0, packed=False)


def adapted(base: Path):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


def lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trained_loss_equals_the_models_own_with_and_without_images(world, family):
    base, folder = world["bases"][family], world["root"]
    model = adapted(base)
    for rows in ([row("red", "img/red.png"), row("blue", "img/blue.png"), row("green")], [row("green"), row("red")]):
        batch, text_only = micro_batch(base, folder, rows)
        inputs = dict(batch.inputs)
        ours = CausalLMLoss(model, None)(**inputs, num_items_in_batch=batch.label_tokens)
        ours.backward()
        ours_grads = lora_grads(model)
        if not any(r["messages"][0]["content"][0]["type"] == "image" for r in rows):
            # No image in the micro-batch: ours carries a blank one that nothing attends to; the
            # model's own forward takes the text alone.
            assert inputs["input_ids"].shape[1] > text_only.inputs["input_ids"].shape[1]
            inputs = text_only.inputs
        theirs = model(**inputs).loss
        theirs.backward()
        theirs_grads = lora_grads(model)
        assert abs(ours.item() - theirs.item()) < 1e-5 * abs(theirs.item())
        assert ours_grads.keys() == theirs_grads.keys() and ours_grads
        for name, g in theirs_grads.items():
            assert torch.allclose(ours_grads[name], g, rtol=1e-4, atol=1e-7), name
        assert not any(p.grad is not None for n, p in model.named_parameters() if "lora" not in n)


def test_training_reaches_the_image_and_never_adapts_the_vision_tower(world, capsys):
    root, base = world["root"], world["bases"]["gemma3"]
    names = list(COLOURS) * 2
    runs = {
        "images": [row(c, f"img/{c}.png") for c in names],
        "other-images": [row(c, f"img/other-{c}.png") for c in names],
        "no-images": [row(c) for c in names],
    }
    losses, adapters = {}, {}
    for name, rows in runs.items():
        data = write_jsonl(root / f"{name}.jsonl", rows)
        code, out, err = run_cli(fast_train_args(base, data, root / f"out-{name}", max_steps=2, data_cache=False), capsys)
        assert code == 0, err
        losses[name] = [m["loss"] for m in read_metrics(root / f"out-{name}") if "loss" in m]
        adapters[name] = adapter_tensors(root / f"out-{name}")
        assert ("packing off: rows with images train in padded batches" in out + err) == (name != "no-images")
        assert "k_proj, q_proj, v_proj also name layers outside the language model (vision tower / projector)" in out + err
    assert losses["images"][0] != losses["other-images"][0] != losses["no-images"][0]
    assert all(not torch.equal(adapters["images"][k], adapters["other-images"][k]) for k in adapters["images"] if "lora_B" in k)
    keys = list(adapters["images"])
    assert keys and all("language_model" in k for k in keys)
    assert not any(part in k for k in keys for part in ("vision_tower", "multi_modal_projector", "vision_model"))


def test_train_vision_is_refused_in_one_line(world, capsys, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [row("red", str(world["root"] / "img/red.png"))])
    code, _, err = run_cli(fast_train_args(world["bases"]["gemma3"], data, tmp_path / "out", train_vision=True), capsys)
    assert code == 2 and single_error_line(err).startswith("error: --train-vision: LoRA on the vision tower and projector is not built")
    assert not (tmp_path / "out").exists()


def test_notebooks_show_image_rows_with_their_image_tokens_untrained(world, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [row("red", str(world["root"] / "img/red.png"))])
    (page,) = show_samples(data, str(world["bases"]["gemma3"]), n=1, data_cache=False)
    assert page.count('<span style="color:#999">&lt;image_soft_token&gt;</span>') == 4 and "color:#0a7d2c" in page


def test_a_missing_image_is_one_error_line_before_anything_is_written(world, capsys, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [row("red", str(world["root"] / "img/red.png")), row("blue", "img/nowhere.png")])
    code, _, err = run_cli(fast_train_args(world["bases"]["llava"], data, tmp_path / "out"), capsys)
    line = single_error_line(err)
    assert code == 2 and line.startswith(f"error: --data {data}: row 2: image img/nowhere.png not found"), line
    assert not (tmp_path / "out").exists()
