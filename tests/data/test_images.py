"""Image-text rows: both data styles, image tokens counted by the base's own processor and never
trained or cut, bad images refused in one line naming the row, the cache noticing a replaced image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from lora_tune.data.batching import collate
from lora_tune.data.prepare import Sample, prepare_data
from lora_tune.data.tokenize import DROPPED_LONG, Tokenize
from lora_tune.errors import UserError
from lora_tune.models.head import IGNORE
from lora_tune.models.loading import load_config, load_tokenizer
from lora_tune.models.processors import load_image_text
from lora_tune.models.tiny.vision import build_tiny_image_text_model

from helpers import data_config, write_jsonl

FAMILIES = ("gemma3", "llava", "paddleocr_vl")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_text_bases")
    return {family: build_tiny_image_text_model(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pictures")
    (folder / "img").mkdir()
    for name, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        Image.new("RGB", (64, 48), colour).save(folder / "img" / f"{name}.png")
    (folder / "img" / "broken.png").write_bytes(b"\x89PNG not really")
    return folder


def typed(image: str, answer: str = "It is red.") -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What colour is this?"}]},
            {"role": "assistant", "content": answer},
        ]
    }


def placeholder(image: str, answer: str = "It is red.") -> dict:
    return {
        "conversations": [{"from": "human", "value": "<image>What colour is this?"}, {"from": "gpt", "value": answer}],
        "images": [image],
    }


def tokenize(base: Path, fmt: str, rows: list[dict], folder: Path, **options) -> dict:
    cfg = data_config(**options)
    image_text = load_image_text(str(base), load_config(str(base), False), cfg)
    fn = Tokenize(load_tokenizer(str(base), False), fmt, cfg, "d.jsonl", image_text=image_text, folder=folder)
    return fn({k: [r.get(k) for r in rows] for k in rows[0]}, list(range(len(rows))))


@pytest.mark.parametrize("family", FAMILIES)
def test_both_styles_give_the_processors_own_tokens_with_images_untrained(bases, pictures, family):
    cfg = data_config()
    image_text = load_image_text(str(bases[family]), load_config(str(bases[family]), False), cfg)
    a = tokenize(bases[family], "messages", [typed("img/red.png")], pictures)
    b = tokenize(bases[family], "sharegpt", [placeholder(str(pictures / "img/red.png"))], pictures)  # absolute paths too
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
    ids, labels = a["input_ids"][0], a["labels"][0]
    # The processor on the whole rendered conversation gives the same ids (plus the EOS the data stage appends).
    text = image_text.processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}, typed("")["messages"][1]],
        tokenize=False,
    )
    whole = image_text.expand(text, [Image.open(pictures / "img/red.png").convert("RGB")])
    assert ids[: len(whole)] == whole
    images = [i for i, t in enumerate(ids) if t == image_text.image_token_id]
    assert len(images) == 4  # the tiny processors' 4 tokens per image
    assert all(labels[i] == IGNORE for i in images)
    trained = [t for t in labels if t != IGNORE]
    assert trained and image_text.image_token_id not in trained
    assert a["images"] == [[str((pictures / "img/red.png").resolve())]] and len(a["image_hashes"][0][0]) == 24
    # TRL's style: image parts without a file, the files in an `images` column, in order.
    trl = typed("img/red.png")
    del trl["messages"][0]["content"][0]["image"]
    assert tokenize(bases[family], "messages", [{**trl, "images": ["img/red.png"]}], pictures)["input_ids"] == a["input_ids"]
    # Even with the prompt trained, image tokens and their begin/end markers carry no label.
    c = tokenize(bases[family], "messages", [typed("img/red.png")], pictures, train_on_prompt=True)
    assert all(c["labels"][0][i] == IGNORE for i in images) and sum(t != IGNORE for t in c["labels"][0]) > len(trained)
    markers = {"gemma3": [512, 513], "paddleocr_vl": [514, 515], "llava": []}[family]
    assert all(m in ids for m in markers) and not any(t in markers for t in c["labels"][0])


def test_a_cut_never_falls_inside_the_image_tokens(bases, pictures):
    row = typed("img/red.png")
    full = tokenize(bases["gemma3"], "messages", [row], pictures)["input_ids"][0]
    start = full.index(514)  # Gemma 3's image soft tokens: 4 from here
    with pytest.raises(UserError, match=r"d.jsonl: row 1: its image tokens run past --max-seq-len 12 .*--long-samples drop"):
        tokenize(bases["gemma3"], "messages", [row], pictures, max_seq_len=start + 2)
    dropped = tokenize(bases["gemma3"], "messages", [row], pictures, max_seq_len=start + 2, long_samples="drop")
    assert dropped["status"] == [DROPPED_LONG] and dropped["images"] == [[]]
    cut = tokenize(bases["gemma3"], "messages", [row], pictures, max_seq_len=len(full) - 2)  # after the image: truncated
    assert len(cut["input_ids"][0]) == len(full) - 2 and cut["images"][0]


@pytest.mark.parametrize(
    "row, fmt, message",
    [
        (typed("img/missing.png"), "messages", r"row 1: image img/missing.png not found .*relative to the data file's folder"),
        (typed("img/broken.png"), "messages", r"row 1: .*broken.png is not a readable image"),
        (typed("https://example.com/a.png"), "messages", r"row 1: image https://example.com/a.png is a URL; .*offline"),
        (
            {**placeholder("img/red.png"), "images": ["img/red.png", "img/blue.png"]},
            "sharegpt",
            r"row 1: 1 <image> placeholder\(s\) in the text but 2 image\(s\) in 'images'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
            "messages",
            r"row 1: an image part without a file",
        ),
        ({**placeholder("img/red.png"), "images": []}, "sharegpt", r"row 1: 1 <image> placeholder\(s\) in the text but 0 image\(s\)"),
        (
            {"messages": [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "x"}]},
            "messages",
            r"row 1: its text holds the image token '<image>' but the row gives no image",
        ),
        (
            {"prompt": "<image>Which is better?", "chosen": "a", "rejected": "b", "images": ["img/red.png"]},
            "preference",
            r"row 1: an 'images' column; images train in sft chat data",
        ),
    ],
)
def test_bad_images_are_one_line_naming_the_row(bases, pictures, row, fmt, message):
    with pytest.raises(UserError, match=message):
        tokenize(bases["llava"], fmt, [row], pictures)


def test_images_given_to_a_text_only_base_are_refused(tiny_model, pictures):
    fn = Tokenize(load_tokenizer(str(tiny_model), False), "messages", data_config(), "d.jsonl", image_text=None, folder=pictures)
    with pytest.raises(UserError, match=r"row 1: the row has images but --base is a text-only model"):
        fn({"messages": [typed("img/red.png")["messages"]]}, [0])


def test_micro_batches_carry_their_images_or_a_blank_one_for_the_tower(bases, pictures):
    cfg = data_config()
    image_text = load_image_text(str(bases["paddleocr_vl"]), load_config(str(bases["paddleocr_vl"]), False), cfg)
    out = tokenize(bases["paddleocr_vl"], "messages", [typed("img/red.png"), typed("img/blue.png")], pictures)
    samples = [Sample(out["input_ids"][i], out["labels"][i], out["starts"][i], images=out["images"][i]) for i in range(2)]
    batch = collate([[s] for s in samples], 0, packed=False, image_text=image_text)
    assert batch.inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]  # 56 x 42 -> a 4 x 4 patch grid each
    assert batch.inputs["pixel_values"].shape[0] == 32 and batch.inputs["input_ids"].shape[1] == len(samples[0].input_ids)
    assert torch.equal(batch.inputs["mm_token_type_ids"], (batch.inputs["input_ids"] == 512).long())
    text = Sample(samples[0].input_ids[:3], samples[0].labels[:3])
    alone = collate([[text]], 0, packed=False, image_text=image_text, blank_image=False)  # one process: the text alone
    assert alone.inputs["input_ids"].tolist() == [text.input_ids] and "pixel_values" not in alone.inputs
    blank = collate([[text]], 0, packed=False, image_text=image_text)
    ids, mask, labels = blank.inputs["input_ids"], blank.inputs["attention_mask"], blank.inputs["labels"]
    # A blank image after the row's end: its tokens unattended and untrained, the text's untouched.
    assert ids[0, :3].tolist() == text.input_ids and ids.shape[1] > 3 and (ids[0, 3:] == 512).sum() == 4
    assert mask[0].tolist() == [1, 1, 1] + [0] * (ids.shape[1] - 3) and (labels[0, 3:] == IGNORE).all()
    assert blank.inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert blank.label_tokens == collate([[text]], 0, packed=False).label_tokens


def test_the_cache_notices_a_replaced_image(bases, pictures, tmp_path):
    folder = tmp_path / "data"
    (folder / "img").mkdir(parents=True)
    Image.new("RGB", (64, 48), (220, 20, 20)).save(folder / "img" / "a.png")
    data = write_jsonl(folder / "d.jsonl", [typed("img/a.png"), typed("img/a.png", "Still red.")])
    cfg = data_config(data=str(data), data_cache_dir=str(tmp_path / "cache"))
    image_text = load_image_text(str(bases["gemma3"]), load_config(str(bases["gemma3"]), False), cfg)
    tok = load_tokenizer(str(bases["gemma3"]), False)
    first = prepare_data(cfg, tok, image_text=image_text)
    again = prepare_data(cfg, tok, image_text=image_text)
    assert again.fingerprint == first.fingerprint and first.images == (2, 0)
    Image.new("RGB", (64, 48), (20, 20, 220)).save(folder / "img" / "a.png")  # same path, another picture
    replaced = prepare_data(cfg, tok, image_text=image_text)
    assert replaced.fingerprint != first.fingerprint
    assert json.dumps(replaced.train[0].images) == json.dumps([str((folder / "img" / "a.png").resolve())])
