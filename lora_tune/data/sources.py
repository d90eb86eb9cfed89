"""Where training data comes from: local files and folders or hub datasets, each with an optional
weight, column mapping and split; loaded with `datasets` (Arrow, memory-mapped), fingerprinted by
content so the tokenized cache knows when they change.

Local files are never read back from `datasets`' own cache: it keys them by path and modification
time, not bytes, so a file rewritten with the same size and mtime (`cp -p`, `rsync -t`, `tar -x`)
would come back with its old rows. Their raw Arrow copy is built in a folder the caller owns (the
tokenized cache's temporary build folder) and removed with it."""

from __future__ import annotations

import csv
import errno
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet

from lora_tune.data import formats
from lora_tune.errors import TrainingStopped, UserError, first_line
from lora_tune.models.aliases import check_hub_reachable

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Source:
    path: str  # a local file or folder, or a hub dataset name
    option: str = "--data"
    weight: float | None = None
    columns: dict = field(default_factory=dict, hash=False)  # format's column name -> the source's
    config: str | None = None  # hub dataset configuration
    split: str = "train"

    @property
    def label(self) -> str:
        return self.path if self.split == "train" and not self.config else f"{self.path}:{self.config or ''}:{self.split}"


def parse_columns(text: str | None, option: str = "--data-columns") -> dict[str, str]:
    """'instruction=question,output=answer' -> {'instruction': 'question', 'output': 'answer'}."""
    if not text:
        return {}
    mapping = {}
    for part in text.split(","):
        target, _, source = part.partition("=")
        if not target.strip() or not source.strip():
            raise UserError(f"{option}: {part!r} is not NAME=COLUMN; write e.g. instruction=question,output=answer")
        mapping[target.strip()] = source.strip()
    return mapping


def parse_sources(entries, weights, columns_text, option: str = "--data") -> list[Source]:
    """The --data entries (strings or, from YAML, mappings with path/weight/columns/split/config)."""
    if entries is None:
        return []
    entries = [entries] if isinstance(entries, (str, dict)) else list(entries)
    if weights is not None and len(weights) != len(entries):
        raise UserError(f"--data-weights: {len(weights)} weights for {len(entries)} sources; give one weight per --data source")
    shared = parse_columns(columns_text)
    sources = []
    for i, entry in enumerate(entries):
        weight = weights[i] if weights is not None else None
        if isinstance(entry, dict):
            unknown = set(entry) - {"path", "weight", "columns", "config", "split"}
            if "path" not in entry or unknown:
                raise UserError(
                    f"{option}: source {i + 1} must be a path or a mapping of path, weight, columns, config, split (got {sorted(entry)})"
                )
            columns = entry.get("columns") or {}
            columns = parse_columns(columns) if isinstance(columns, str) else dict(columns)
            weight = entry.get("weight", weight)
            path, config, split = str(entry["path"]), entry.get("config"), entry.get("split") or "train"
        else:
            path, config, split, columns = str(entry), None, "train", {}
            if not Path(path).expanduser().exists() and path.count(":") == 2:  # hub name:config:split
                path, config, split = path.split(":")
                config, split = config or None, split or "train"
        if weight is not None and not weight > 0:
            raise UserError(f"{option}: the weight of {path} must be > 0 (got {weight})")
        sources.append(Source(path, option, weight, {**shared, **columns}, config, split))
    return sources


def local_files(source: Source) -> list[Path] | None:
    """The files of a local source (None for a hub dataset); refuses what can't be read."""
    path = Path(source.path).expanduser()
    option, name = source.option, source.path
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise UserError(f"{option}: {name} has an unsupported extension; use .jsonl, .json, .parquet or .csv")
        if is_blank(path):
            raise UserError(f"{option}: {name} is empty; it needs at least one sample")
        return [path]
    if path.is_dir():
        files = [p for p in sorted(path.iterdir()) if p.suffix.lower() in SUFFIXES]
        if not files:
            raise UserError(f"{option}: folder {name} holds no .jsonl/.json/.parquet/.csv files")
        if len({SUFFIXES[p.suffix.lower()] for p in files}) > 1:
            raise UserError(f"{option}: folder {name} mixes file types; keep one kind per folder")
        return files
    if name.startswith((".", "/", "~")) or path.suffix.lower() in SUFFIXES:
        raise UserError(f"{option}: {name} does not exist; give a local file or folder, or a hub dataset name")
    check_hub_reachable(name, option, "dataset")
    return None


def is_blank(path: Path, block: int = 1 << 16) -> bool:
    """True when the file holds nothing but whitespace; reads a block at a time and stops at the
    first other byte (a 400 MB file costs one block of memory, not the file)."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            if chunk.strip():
                return False
    return True


def content_hash(source: Source, files: list[Path] | None) -> str:
    """Of the bytes of a local source's files, or of a hub dataset's own fingerprint."""
    h = hashlib.sha256()
    if files is None:
        h.update(load(source, None)._fingerprint.encode())
        return h.hexdigest()
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def stop_of(error: BaseException | None) -> TrainingStopped | None:
    """The TrainingStopped (SIGTERM) behind an error the libraries wrapped, if that is what it is."""
    while error is not None:
        if isinstance(error, TrainingStopped):
            return error
        error = error.__cause__ or error.__context__
    return None


def no_room(error: BaseException | None) -> OSError | None:
    """The 'disk full' (or quota) OSError behind an error, however deeply the libraries wrapped it."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return error
        error = error.__cause__ or error.__context__
    return None


def load(source: Source, files: list[Path] | None, raw_dir: Path | None = None):
    """The raw records as a `datasets.Dataset` (Arrow, memory-mapped), columns renamed to the
    format's names. Local files are converted to Arrow under `raw_dir` (a fresh folder the caller
    owns and removes), never read from `datasets`' own cache, which keys them by path and mtime.
    A full disk there is raised as the OSError it is (the caller may build elsewhere)."""
    datasets.disable_progress_bars()
    try:
        if files is None:
            ds = datasets.load_dataset(source.path, source.config, split=source.split)
        else:
            where = {"cache_dir": str(raw_dir)} if raw_dir is not None else {"download_mode": "force_redownload"}
            ds = datasets.load_dataset(SUFFIXES[files[0].suffix.lower()], data_files=[str(p) for p in files], split="train", **where)
    except PermissionError:
        raise UserError(f"{source.option}: {source.path} is not readable (permission denied)") from None
    except Exception as e:  # datasets raises many types for a bad file or an unreachable hub
        stopped = stop_of(e)
        if stopped is not None:
            raise stopped from None
        full = no_room(e)
        if full is not None:
            raise full from None
        check_utf8(files, source.option)
        for path in files or []:
            if SUFFIXES[path.suffix.lower()] == "json":
                check_json_file(path, source.option)  # finds the broken line, if that is the cause
        if files and len(files) > 1:
            check_same_columns(files, source)  # datasets can't put a folder's files of other columns in one table
        raise UserError(f"{source.option}: could not load {source.label}: {first_line(root_cause(e))}") from None
    if len(ds) == 0:
        raise UserError(f"{source.option}: {source.label} is empty; it needs at least one sample")
    missing = [c for c in source.columns.values() if c not in ds.column_names]
    if missing:
        raise UserError(
            f"{source.option}: {source.label} has no column {missing[0]!r} to map (its columns: {ds.column_names}); fix --data-columns"
        )
    renames = {old: new for new, old in source.columns.items() if old != new}
    clash = [new for new in renames.values() if new in ds.column_names and new not in renames]
    if clash:
        raise UserError(
            f"{source.option}: mapping onto {clash[0]!r}, which {source.label} already has; map that column too or drop the mapping"
        )
    return ds.rename_columns(renames) if renames else ds


def check_json_file(path: Path, option: str) -> None:
    """Parse JSON / JSON-lines ourselves, so a broken line is reported with its number (a line at a
    time: a large file is never held whole, except a .json array, which is one value)."""
    with open(path, "rb") as f:
        first = f.read(1 << 16).lstrip()
    if path.suffix == ".json" and first.startswith(b"["):
        try:
            rows = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except json.JSONDecodeError as e:
            raise UserError(f"{option}: {path} is not valid JSON at line {e.lineno}: {e.msg}; fix that line") from None
        if not all(isinstance(r, dict) for r in rows):
            raise UserError(f"{option}: {path} must be a list of objects (one per sample)")
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{option}: {path} line {number} is not valid JSON ({e.msg}); fix or remove that line") from None
            if not isinstance(row, dict):
                raise UserError(f'{option}: {path} line {number} is not a JSON object; each line must be one sample like {{"text": ...}}')


def root_cause(error: BaseException) -> BaseException:
    """The error under the wrappers ('An error occurred while generating the dataset' says nothing)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return error


def check_utf8(files: list[Path] | None, option: str) -> None:
    """JSON and CSV files are UTF-8 text. pyarrow reads bytes that are not into strings unchecked, and
    the row holding them fails later, deep in datasets, naming nothing: the first such line, said."""
    for path in files or []:
        if SUFFIXES[path.suffix.lower()] not in ("json", "csv"):
            continue
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(
                        f"{option}: {path} line {number} is not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1}); "
                        "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                    ) from None


def first_columns(path: Path) -> list[str] | None:
    """The columns of a file's first row (a parquet file's schema, a CSV file's header); None when it
    has none to read."""
    kind = SUFFIXES[path.suffix.lower()]
    if kind == "parquet":
        return pyarrow.parquet.read_schema(path).names
    with open(path, encoding="utf-8") as f:
        if kind == "csv":
            return next(csv.reader(f), None)
        if path.suffix == ".json" and f.read(1 << 16).lstrip().startswith("["):
            rows = json.loads(path.read_text(encoding="utf-8"))
            return list(rows[0]) if rows and isinstance(rows[0], dict) else None
        f.seek(0)
        line = next((line for line in f if line.strip()), None)
    row = json.loads(line) if line else None
    return list(row) if isinstance(row, dict) else None


def check_same_columns(files: list[Path], source: Source) -> None:
    """A folder's files are one table to datasets: files of other columns (an alpaca file beside a
    chat file) fail with 'An error occurred while generating the dataset'. Said with the files, and
    their formats when those differ."""
    seen = []
    for path in files:
        try:
            columns = first_columns(path)
        except (OSError, ValueError, pyarrow.ArrowException):  # a file broken otherwise: the caller's message says so
            continue
        if columns is not None:
            seen.append((path, columns))
    for (a, cols_a), (b, cols_b) in zip(seen, seen[1:]):
        if set(cols_a) == set(cols_b):
            continue
        kinds = []
        for columns in (cols_a, cols_b):
            try:
                kinds.append(formats.detect(columns, "", source.option).NAME)
            except UserError:
                kinds.append("no format")
        if kinds[0] != kinds[1]:
            raise UserError(
                f"{source.option}: folder {source.path} mixes data formats: {a.name} is {kinds[0]} ({', '.join(cols_a)}), {b.name} "
                f"is {kinds[1]} ({', '.join(cols_b)}); give each file as its own --data source"
            )
        raise UserError(
            f"{source.option}: the files of folder {source.path} have other columns: {a.name} has {sorted(cols_a)}, {b.name} has "
            f"{sorted(cols_b)}; give every file the same columns, or each file as its own --data source"
        )
