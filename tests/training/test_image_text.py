"""Image-text training: the loss the engines train equals the model's own loss on the same inputs
(three families: multimodal rotary positions, token types + projector, a LLaVA projector), the
image reaches the loss, and the vision tower and projector stay frozen and unadapted."""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import PeftModel
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from lora_tune.data.batching import collate
from lora_tune.data.prompts import read_eval_prompts
from lora_tune.models.loading import load_tokenizer
from lora_tune.models.tiny.vision import build_tiny_image_text_model
from lora_tune.notebook import show_samples
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
    samples_of,
    single_error_line,
    write_jsonl,
)

FAMILIES = ("paddleocr_vl", "gemma3", "llava")
WITH_TOWER = ["q_proj", "v_proj", "fc1", "linear_1"]  # every q/v, fc1 and projector linear too (--train-vision)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("image_text_training")
    colour_images(root)
    bases = {family: build_tiny_image_text_model(family, root / family) for family in FAMILIES}
    return {"root": root, "bases": bases}


@pytest.mark.parametrize("family,vision", [(f, False) for f in FAMILIES] + [("paddleocr_vl", True), ("gemma3", True)])
def test_the_trained_loss_equals_the_models_own_with_and_without_images(world, family, vision):
    base, folder = world["bases"][family], world["root"]
    model = adapted_image_text_model(base, WITH_TOWER if vision else LANGUAGE_QV)
    for rows in ([row("red", "img/red.png"), row("blue", "img/blue.png"), row("green")], [row("green"), row("red")]):
        batch, text_only = micro_batch(base, folder, rows)
        inputs = dict(batch.inputs)
        ours = CausalLMLoss(model, None)(**inputs, num_items_in_batch=batch.label_tokens)
        ours.backward()
        ours_grads = lora_grads(model)
        images = any(r["messages"][0]["content"][0]["type"] == "image" for r in rows)
        if not images:
            # No image in the micro-batch: ours carries a blank one that nothing attends to; the
            # model's own forward takes the text alone.
            assert inputs["input_ids"].shape[1] > text_only.inputs["input_ids"].shape[1]
            inputs = text_only.inputs
        theirs = model(**inputs).loss
        theirs.backward()
        theirs_grads = lora_grads(model)
        assert abs(ours.item() - theirs.item()) < 1e-5 * abs(theirs.item())
        # The blank image reaches the tower's LoRA (vision) with exactly zero gradient: nothing attends to it.
        blank = {n for n in ours_grads.keys() - theirs_grads.keys() if not ours_grads[n].any()}
        assert ours_grads.keys() - blank == theirs_grads.keys() and theirs_grads
        assert bool(blank) == (vision and not images)
        for name, g in theirs_grads.items():
            assert torch.allclose(ours_grads[name], g, rtol=1e-4, atol=1e-7), name
        assert not any(p.grad is not None for n, p in model.named_parameters() if "lora" not in n)
        if vision and images:  # the tower's LoRA reached (and PaddleOCR-VL's projector's: Gemma 3's has no linear)
            assert any("vision_tower" in n or "visual" in n for n in theirs_grads)
            assert any("projector" in n for n in theirs_grads) == (family == "paddleocr_vl")


def loss_and_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    loss = CausalLMLoss(model, None)(**batch.inputs, num_items_in_batch=batch.label_tokens)
    loss.backward()
    return loss.item(), lora_grads(model)


def test_packed_rows_with_images_equal_padded_ones_where_the_family_packs_exactly(world):
    """LLaVA: images take plain positions and causal attention, so a packed row (positions restart per
    sample) computes what padded rows do, with the tower's LoRA too; the blank image of an image-less
    packed micro-batch is a sample of its own that changes nothing."""
    base, folder = world["bases"]["llava"], world["root"]
    model = adapted_image_text_model(base, WITH_TOWER)
    samples, image_text = samples_of(base, folder, [row("red", "img/red.png"), row("green"), row("blue", "img/other-blue.png")])
    assert image_text.packing_refusal is None
    packed = collate([samples], 0, packed=True, image_text=image_text)
    assert packed.inputs["input_ids"].shape[0] == 1 and packed.inputs["pixel_values"].shape[0] == 2
    padded_loss, padded_grads = loss_and_grads(model, collate([[s] for s in samples], 0, packed=False, image_text=image_text))
    packed_loss, packed_grads = loss_and_grads(model, packed)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    assert packed_grads.keys() == padded_grads.keys() and any("vision_tower" in n for n in packed_grads)
    for name, g in padded_grads.items():
        assert torch.allclose(packed_grads[name], g, rtol=1e-4, atol=1e-7), name
    text = samples[1:2]
    blank = collate([text], 0, packed=True, image_text=image_text)
    assert "pixel_values" in blank.inputs and blank.inputs["input_ids"].shape[1] > len(text[0].input_ids)
    alone_loss, alone_grads = loss_and_grads(model, collate([text], 0, packed=True, image_text=image_text, blank_image=False))
    blank_loss, blank_grads = loss_and_grads(model, blank)
    assert blank_loss == pytest.approx(alone_loss, rel=1e-6)
    for name, g in alone_grads.items():
        assert torch.allclose(blank_grads[name], g, rtol=1e-5, atol=1e-8), name


def test_families_whose_images_cant_pack_exactly_train_them_padded(world):
    for family, reason in (
        ("paddleocr_vl", "paddleocr_vl computes multimodal rotary positions over the whole sequence"),
        ("gemma3", "gemma3's image tokens take token types (token_type_ids, mm_token_type_ids)"),
    ):
        _, image_text = samples_of(world["bases"][family], world["root"], [row("red")])
        assert image_text.packing_refusal == reason


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
        assert (
            "packing off: gemma3's image tokens take token types (token_type_ids, mm_token_type_ids), so rows with images" in out + err
        ) == (name != "no-images")
        assert "k_proj, q_proj, v_proj also name layers outside the language model (vision tower / projector)" in out + err
    assert losses["images"][0] != losses["other-images"][0] != losses["no-images"][0]
    assert all(not torch.equal(adapters["images"][k], adapters["other-images"][k]) for k in adapters["images"] if "lora_B" in k)
    keys = list(adapters["images"])
    assert keys and all("language_model" in k for k in keys)
    assert not any(part in k for k in keys for part in ("vision_tower", "multi_modal_projector", "vision_model"))


def test_train_vision_adapts_and_trains_every_linear_of_the_tower_and_projector(world, capsys, tmp_path):
    base = world["bases"]["llava"]
    data = write_jsonl(tmp_path / "d.jsonl", [row(c, str(world["root"] / f"img/{c}.png")) for c in COLOURS])
    code, out, err = run_cli(fast_train_args(base, data, tmp_path / "out", max_steps=2, data_cache=False, train_vision=True), capsys)
    assert code == 0, err
    assert "vision linear_1 x1, vision linear_2 x1, vision fc1 x2, vision fc2 x2, vision k_proj x2" in out + err
    assert "also name layers outside the language model" not in out + err
    model = AutoModelForImageTextToText.from_pretrained(base)
    vision = {
        f"{root}.{name}"
        for root in ("model.vision_tower", "model.multi_modal_projector")
        for name, m in model.get_submodule(root).named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    tensors = adapter_tensors(tmp_path / "out")
    adapted = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in tensors if "language_model" not in k}
    assert adapted == vision and len(vision) == 14
    # Every one of them trained (the last CLIP layer's output feeds the projector: vision_feature_layer -1).
    assert all(tensors[k].abs().max() > 0 for k in tensors if "lora_B" in k)


def test_train_vision_and_vision_target_names_are_refused_where_they_cannot_apply(world, capsys, tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", [row("red", str(world["root"] / "img/red.png"))])
    code, _, err = run_cli(fast_train_args(world["bases"]["llava"], data, tmp_path / "out", target_modules=["q_proj", "linear_1"]), capsys)
    line = single_error_line(err)
    assert (
        code == 2
        and line.startswith("error: --target-modules: linear_1 is a layer of the vision tower / projector")
        and "--train-vision" in line
    )
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello there"}] * 2)
    code, _, err = run_cli(fast_train_args(tiny_model, text, tmp_path / "out", train_vision=True), capsys)
    assert code == 2 and single_error_line(err).startswith("error: --train-vision: the base is a text-only model")
    assert not (tmp_path / "out").exists()


def test_eval_prompts_with_images_generate_as_the_model_does_from_the_processors_inputs(world, capsys, tmp_path):
    root, base = world["root"], world["bases"]["llava"]
    data = write_jsonl(tmp_path / "d.jsonl", [row(c, str(root / f"img/{c}.png")) for c in COLOURS])
    question = [{"type": "image", "image": "../img/red.png"}, {"type": "text", "text": "What colour is this?"}]
    (tmp_path / "prompts").mkdir()
    prompts = write_jsonl(tmp_path / "prompts" / "p.jsonl", [{"messages": [{"role": "user", "content": question}]}, {"prompt": "Hi"}])
    shutil.copytree(root / "img", tmp_path / "img")  # relative to the prompts file's folder
    args = fast_train_args(base, data, tmp_path / "out", max_steps=2, eval_steps=2, eval_prompts=prompts, eval_max_new_tokens=6)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    (record,) = [m for m in read_metrics(tmp_path / "out") if "samples" in m]
    image_sample, text_sample = record["samples"]
    assert image_sample["images"] == [str((tmp_path / "img" / "red.png").resolve())] and "images" not in text_sample
    # The adapter on the base, given the processor's own inputs for the same turn and image.
    processor = AutoProcessor.from_pretrained(base)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [question[0] | {"image": None}, question[1]]}], add_generation_prompt=True
    )
    inputs = processor(text=[text], images=[Image.open(root / "img/red.png").convert("RGB")], return_tensors="pt", add_special_tokens=False)
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), tmp_path / "out").eval()
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert image_sample["completion"] == processor.tokenizer.decode(ids, skip_special_tokens=True)
    (prompt,) = read_eval_prompts(str(prompts), load_tokenizer(str(base), False), image_text=load_image_text_of(base))[:1]
    assert prompt.ids == inputs["input_ids"][0].tolist() and torch.equal(prompt.pixel_inputs["pixel_values"], inputs["pixel_values"])


def test_eval_prompt_images_are_checked_before_training(world, capsys, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [row("red")])
    question = [{"type": "image", "image": "nowhere.png"}, {"type": "text", "text": "What colour is this?"}]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": question}]}])
    code, _, err = run_cli(fast_train_args(world["bases"]["llava"], data, tmp_path / "out", eval_prompts=prompts), capsys)
    line = single_error_line(err)
    assert code == 2 and line.startswith(f"error: --eval-prompts {prompts}: line 1: image nowhere.png not found")
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
