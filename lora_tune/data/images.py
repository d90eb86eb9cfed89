"""Images of image-text data: where a reference points, whether it is an image, its content hash,
and the picture the processor gets, bounded in pixels.

A reference is a path, relative to the data file's folder (or absolute); an http(s) URL is refused:
nothing is fetched during training (a run must not depend on a server, and the cache could not
know that the picture behind a URL changed). Each image is checked when its row is tokenized (it
opens and decodes, and its size gives the image tokens), its bytes hashed so a cached dataset notices
a replaced file, and decoded again only when its micro-batch is built: once per use, never kept.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from lora_tune.errors import UserError

URL_PREFIXES = ("http://", "https://")
Image.MAX_IMAGE_PIXELS = 200_000_000  # PIL's bomb guard, raised for large scans; --max-pixels scales them down anyway


def resolve(ref, folder: Path, where: str) -> Path:
    """The file an image reference names (a path relative to `folder`, the data file's)."""
    if isinstance(ref, dict):  # {"path": ...} as datasets' Image feature writes it, or {"bytes": ...}
        if ref.get("path"):
            ref = ref["path"]
        else:
            raise UserError(f"{where}: an image given as embedded bytes; save it as a file and give its path")
    if not isinstance(ref, str) or not ref.strip():
        raise UserError(f"{where}: an image must be given as a file path (got {type(ref).__name__})")
    if ref.startswith(URL_PREFIXES):
        raise UserError(f"{where}: image {ref} is a URL; lora-tune trains offline: download it and give its path instead")
    path = Path(ref).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise UserError(f"{where}: image {ref} not found (looked for {path}); paths are relative to the data file's folder")
    return path.resolve()


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:24]


def load(path: str | Path, where: str, max_pixels: int, min_pixels: int = 0) -> Image.Image:
    """The image as RGB, scaled (aspect kept) into [min_pixels, max_pixels] pixels."""
    try:
        with Image.open(path) as opened:
            image = opened.convert("RGB")  # decodes it: a truncated or corrupt file fails here
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{where}: {path} is not a readable image ({str(e).splitlines()[0][:120]}); replace or remove it") from None
    pixels = image.width * image.height
    if pixels > max_pixels or (min_pixels and pixels < min_pixels):
        scale = math.sqrt((max_pixels if pixels > max_pixels else min_pixels) / pixels)
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image
