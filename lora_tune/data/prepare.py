"""Data stage: sources -> format -> tokens with loss masks -> (mixed) train and eval samples.

Each source is read with `datasets` (Arrow), its format detected from its columns (after
`--data-columns` renames them), tokenized a batch at a time in `--data-workers` processes, and the
result cached on disk and memory-mapped (`cache`): samples are never held as Python objects, a
second run or a resume starts at once, and the ranks of a job share one build. Several sources are
mixed by weight, deterministically for the seed. Bad input is one `error:` line naming the source,
the row and the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pyarrow
import torch

from lora_tune.data import cache, formats, images, sources
from lora_tune.data.tokenize import DROPPED_CUT, DROPPED_LONG, DROPPED_NO_LABELS, DROPPED_SAME, NO_LABEL, TRUNCATED, Tokenize
from lora_tune.errors import UserError, first_line

PARALLEL_FROM = 20_000  # rows; below this, starting worker processes costs more than it saves


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]
    starts: list[int] = field(default_factory=lambda: [0])  # where each of its sequences begins (a pair: two)
    label: int = NO_LABEL  # KTO: 1 desirable, 0 undesirable
    reference: list[float] | None = None  # precomputed reference log-probability of each sequence
    images: list[str] = field(default_factory=list)  # image files of an image-text row, in order


class Samples:
    """Tokenized samples read from a memory-mapped Arrow table; `lengths` for batching."""

    def __init__(self, dataset=None):
        self.ds = dataset
        self.lengths = [int(n) for n in dataset["length"]] if dataset is not None and len(dataset) else []
        self.reference: torch.Tensor | None = None  # [samples, sequences]: set once precomputed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Sample:
        row = self.ds[int(i)]
        reference = self.reference[int(i)].tolist() if self.reference is not None else None
        return Sample(row["input_ids"], row["labels"], row["starts"], row["label"], reference, row.get("images") or [])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def row(self, i: int) -> dict:
        """A prompt's source row, as the reward functions get its columns (prompts data only)."""
        return json.loads(self.ds[int(i)]["row"])


@dataclass
class DataStats:
    rows: int = 0
    truncated: int = 0
    dropped_long: int = 0
    dropped_no_labels: int = 0
    dropped_same: int = 0
    tokens: int = 0
    dropped_cut: int = 0  # truncated with every trainable token past the cut (cache entries of before count them as no labels)

    def summary(self) -> str:
        same = f", {self.dropped_same} pairs dropped with chosen == rejected" if self.dropped_same else ""
        cut = f", {self.dropped_cut} dropped with every trainable token past --max-seq-len" if self.dropped_cut else ""
        return (
            f"{self.rows} rows; {self.truncated} truncated, {self.dropped_long} dropped as too long, "
            f"{self.dropped_no_labels} dropped with no trainable tokens{cut}{same}"
        )

    def advice(self) -> str:
        """What to change when nothing is left: for the reason most rows were dropped."""
        most = max(self.dropped_same, self.dropped_long, self.dropped_cut)
        if most == 0 or self.dropped_no_labels >= most:
            return "give samples with a response to train on (or pass --train-on-prompt to train on the prompt too)"
        if self.dropped_same == most:
            return "give pairs whose chosen and rejected answers differ"
        if self.dropped_long == most:  # only under --long-samples drop
            return "raise --max-seq-len, or use --long-samples truncate (keeps the start of each long sample)"
        return (  # truncated, the default
            "raise --max-seq-len: samples are cut to it, and those whose response begins past it keep no trainable token (or pass "
            "--train-on-prompt to train on the prompt too)"
        )

    def add(self, other: DataStats) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class PreparedData:
    train: Samples
    eval: Samples
    format: str
    stats: DataStats
    fingerprint: str
    per_source: list[str] = field(default_factory=list)
    images: tuple[int, int] = (0, 0)  # image-text rows among the training and the evaluation samples


def workers(cfg, rows: int) -> int | None:
    if rows < PARALLEL_FROM:
        return None
    return cfg.data_workers or max(1, min(os.cpu_count() or 1, 8))


def image_folder(source: sources.Source, files: list[Path] | None) -> Path:
    """Where the source's image paths are relative to: its file's folder, or the folder it is."""
    if files is None:
        return Path.cwd()
    path = Path(source.path).expanduser()
    return (path if path.is_dir() else path.parent).resolve()


def stale_images(built, image_text) -> str | None:
    """For a source with images: a fingerprint of their current contents and of how images are
    processed now, when either differs from what the cached entry was tokenized with (a replaced
    picture, another processor or --max-pixels retrains: its tokens may differ), else None."""
    ds, meta = built
    if not meta.get("image_rows"):  # a text source: its rows are never read here
        return None
    processing = image_text.fingerprint() if hasattr(image_text, "fingerprint") else None
    stored, current = [], []
    for paths, hashes in zip(ds["images"], ds["image_hashes"]):
        for path, digest in zip(paths, hashes):
            stored.append(digest)
            current.append(images.file_hash(Path(path)) if Path(path).is_file() else "missing")
    if stored == current and meta.get("image_processing") == processing:
        return None
    return hashlib.sha256(json.dumps([current, processing]).encode()).hexdigest()[:16]


def tokenized_source(source: sources.Source, tokenizer, cfg, image_text=None):
    """(dataset of input_ids/labels/length, meta) for one source, from the cache when it is there.
    `image_text`: the base's processor for image rows (`lora_tune.models.processors`), or None."""
    files = sources.local_files(source)
    image_dir = image_folder(source, files)
    parts = {
        "data": sources.content_hash(source, files),
        "columns": source.columns,
        "tokenizer": cache.tokenizer_hash(tokenizer),
        "max_seq_len": cfg.max_seq_len,
        "long_samples": cfg.long_samples,
        "train_on_prompt": cfg.train_on_prompt,
        "system_message": getattr(cfg, "system_message", "auto"),
        "split": [source.config, source.split],
    }
    key = cache.key_of(parts)  # the images' part joins when a row has one (below): text keys stay as they were

    def build(workdir):
        """Tokenize the source into `workdir` (None: in memory); its raw Arrow copy lives in a
        folder of this build only, so what is tokenized is what was hashed."""
        raw_dir = tempfile.TemporaryDirectory(prefix="lora-tune-raw-") if workdir is None else contextlib.nullcontext(workdir / "raw")
        with raw_dir as folder:
            return tokenize_source(Path(folder), workdir)

    def tokenize_source(raw_dir: Path, workdir):
        raw = sources.load(source, files, raw_dir)
        if files is not None and sources.content_hash(source, files) != parts["data"]:
            raise UserError(
                f"{source.option}: {source.label} changed while it was being read; run again once it is no longer being written"
            )
        fmt = formats.detect(raw.column_names, source.label, source.option)
        formats.check_one_format(raw.data.table, fmt, source.label, source.option)
        fn = Tokenize(tokenizer, fmt.NAME, cfg, source.label, source.option, image_text, image_dir)
        ints = datasets.Sequence(datasets.Value("int32"))
        features = datasets.Features(
            {
                "input_ids": ints,
                "labels": ints,
                "starts": ints,
                "label": datasets.Value("int8"),
                "length": datasets.Value("int32"),
                "status": datasets.Value("int8"),
                "images": datasets.Sequence(datasets.Value("string")),
                "image_hashes": datasets.Sequence(datasets.Value("string")),
                **({"row": datasets.Value("string")} if formats.kind(fmt) == "prompts" else {}),
            }
        )
        where = {"keep_in_memory": True} if workdir is None else {"cache_file_name": str(workdir / "tokens.arrow")}
        if workdir is not None:
            workdir.mkdir(parents=True, exist_ok=True)
        ds = raw.map(
            fn,
            batched=True,
            batch_size=1000,
            with_indices=True,
            remove_columns=raw.column_names,
            features=features,
            num_proc=workers(cfg, len(raw)),
            **where,
        )
        status = ds["status"]
        stats = {
            "rows": len(raw),
            "truncated": status.count(TRUNCATED),
            "dropped_long": status.count(DROPPED_LONG),
            "dropped_no_labels": status.count(DROPPED_NO_LABELS),
            "dropped_same": status.count(DROPPED_SAME),
            "dropped_cut": status.count(DROPPED_CUT),
        }
        dropped = {DROPPED_LONG, DROPPED_NO_LABELS, DROPPED_SAME, DROPPED_CUT}
        if any(s in dropped for s in status):
            ds = ds.select([i for i, s in enumerate(status) if s not in dropped], keep_in_memory=workdir is None)
        ds = ds.remove_columns(["status"])
        stats["tokens"] = int(sum(ds["length"]))
        processing = image_text.fingerprint() if hasattr(image_text, "fingerprint") else None
        image_rows = sum(1 for paths in ds["images"] if paths)
        meta = {"format": fmt.NAME, "stats": stats, "key": key, "source": source.label}
        return ds, {**meta, "image_rows": image_rows, "image_processing": processing}

    root = cache.cache_root(cfg) if getattr(cfg, "data_cache", True) else None
    try:
        built = cache.load_or_build(root, key, build, source.label)
        changed = stale_images(built, image_text) if root is not None else None
        if changed:  # an image (or the processing of images) changed since: the entry for them as they are now
            key = cache.key_of({**parts, "images_now": changed})
            built = cache.load_or_build(root, key, build, source.label)
        return built
    except UserError:
        raise
    except Exception as e:  # an error raised in a tokenizing worker process arrives wrapped
        stopped = sources.stop_of(e)
        if stopped is not None:
            raise stopped from None
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
            if isinstance(cause, UserError):
                raise UserError(str(cause), cause.exit_code) from None
        if raised_reading_rows(e):
            sources.check_utf8(files, source.option)  # pyarrow takes bytes that are not UTF-8 unchecked; their row fails here
            raise UserError(
                f"{source.option}: the rows of {source.label} can't be read as columns ({first_line(e)[:160]}); give each column "
                "one type in every row (e.g. text as strings, messages as lists of {role, content})"
            ) from None
        raise


def raised_reading_rows(error: BaseException) -> bool:
    """True for an error that datasets or pyarrow raised turning the source's Arrow rows into Python
    (odd nested keys, mixed types): the data's fault, not ours."""
    frames = traceback.extract_tb(error.__traceback__)
    where = frames[-1].filename if frames else ""
    library = f"{os.sep}datasets{os.sep}" in where or f"{os.sep}pyarrow{os.sep}" in where or where.startswith("pyarrow")
    return library and isinstance(error, (ValueError, KeyError, TypeError, pyarrow.ArrowException))


def mix(datasets_: list, weights: list[float | None], seed: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(source, row) pairs of the mixed set and the count per source. Without weights, every row of
    every source once; with weights, each source's share of the combined size, drawn without
    repetition from a seeded shuffle and repeated whole passes when a source must be upsampled."""
    sizes = [len(d) for d in datasets_]
    if all(w is None for w in weights):
        counts = sizes
    else:
        w = [1.0 if x is None else x for x in weights]
        total = sum(sizes)
        counts = [max(1, round(total * x / sum(w))) for x in w]
    picks = []
    for s, (n, count) in enumerate(zip(sizes, counts)):
        g = torch.Generator().manual_seed(seed * 7919 + s)
        order = []
        while len(order) < count:
            order += torch.randperm(n, generator=g).tolist()
        picks += [(s, i) for i in sorted(order[:count])]
    return picks, counts


def select(datasets_: list, picks: list[tuple[int, int]]):
    if len(datasets_) == 1:
        return datasets_[0].select([i for _, i in picks])
    offsets, at = [], 0
    for d in datasets_:
        offsets.append(at)
        at += len(d)
    return datasets.concatenate_datasets(datasets_).select([offsets[s] + i for s, i in picks])


def check_kinds(refusal, data_sources, built) -> None:
    """Every source's format is data the objective trains on (pairs for DPO, ...): `refusal(kind,
    format, where)` says why not (the objective's rule, `lora_tune.training.objectives`), or None."""
    for source, (_, meta) in zip(data_sources, built):
        reason = refusal(formats.kind(formats.BY_NAME[meta["format"]]), meta["format"], f"{source.option} {source.label}")
        if reason:
            raise UserError(reason)


def prepare_data(cfg, tokenizer, refusal=None, image_text=None) -> PreparedData:
    """The training (and evaluation) samples of --data, tokenized (from the cache when there),
    mixed, and split. `refusal(kind, format, where)`: the objective's word on each source's kind of
    data, checked as soon as it is known (None: any kind). `image_text`: the base's processor
    (`lora_tune.models.processors.load_image_text`), for rows with images."""
    train_sources = sources.parse_sources(cfg.data, getattr(cfg, "data_weights", None), getattr(cfg, "data_columns", None))
    built = [tokenized_source(s, tokenizer, cfg, image_text) for s in train_sources]
    if refusal:
        check_kinds(refusal, train_sources, built)
    picks, counts = mix([d for d, _ in built], [s.weight for s in train_sources], cfg.seed)
    stats, per_source = DataStats(), []
    for source, (ds, meta), count in zip(train_sources, built, counts):
        source_stats = DataStats(**meta["stats"])
        stats.add(source_stats)
        share = f", {count} in the mix (weight {source.weight})" if source.weight is not None else ""
        per_source.append(
            f"{source.label}: {meta['format']}, {source_stats.summary()}; {len(ds)} samples, {source_stats.tokens:,} tokens{share}"
        )
    if not picks or all(len(d) == 0 for d, _ in built):
        raise UserError(f"--data: no usable samples in {', '.join(s.label for s in train_sources)} ({stats.summary()}); {stats.advice()}")
    train = select([d for d, _ in built], picks)
    eval_ds, eval_keys, eval_metas = None, [], []
    if cfg.eval_data:
        eval_sources = sources.parse_sources(cfg.eval_data, None, getattr(cfg, "data_columns", None), "--eval-data")
        eval_built = [tokenized_source(s, tokenizer, cfg, image_text) for s in eval_sources]
        if refusal:
            check_kinds(refusal, eval_sources, eval_built)
        eval_keys = [meta["key"] for _, meta in eval_built]
        eval_metas = [meta for _, meta in eval_built]
        eval_picks, _ = mix([d for d, _ in eval_built], [None] * len(eval_built), cfg.seed)
        eval_ds = select([d for d, _ in eval_built], eval_picks)
    elif cfg.eval_split > 0:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        n_eval = max(1, math.ceil(len(train) * cfg.eval_split))
        eval_ds = train.select(sorted(order[:n_eval]))
        train = train.select(sorted(order[n_eval:]))
    if len(train) == 0:
        raise UserError(f"--data: no samples left for training after holding out --eval-split {cfg.eval_split}; lower it")
    fingerprint = hashlib.sha256(
        json.dumps([[m["key"] for _, m in built], [s.weight for s in train_sources], counts, cfg.seed, cfg.eval_split, eval_keys]).encode()
    ).hexdigest()[:16]
    formats_seen = sorted({m["format"] for _, m in built})
    # Rows with images, in training and in evaluation: their micro-batches carry pixel inputs.
    sources_with_images = any(meta.get("image_rows") for _, meta in built) or any(m.get("image_rows") for m in eval_metas)
    with_images = [sum(1 for paths in ds["images"] if paths) if ds is not None and sources_with_images else 0 for ds in (train, eval_ds)]
    return PreparedData(Samples(train), Samples(eval_ds), "+".join(formats_seen), stats, fingerprint, per_source, tuple(with_images))
