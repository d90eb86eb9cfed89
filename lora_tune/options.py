"""How an option is declared, and how a config is built from YAML and flags: one schema for YAML
files, CLI flags and `--help`.

Every field of a config is a YAML key and a flag (`max_seq_len` <-> `--max-seq-len`); its
description is the help text. Each room declares the options it reads as a section (`Options`
subclasses: `lora_tune.models.options`, `lora_tune.data.options`, ...), composed into the one flat
`lora_tune.config.TrainConfig`. Fields are tagged by how they behave on `--resume` (docs/reference/resume.md's
resume table is generated from these tags): "math" fields change what the run computes: a change is
refused unless `--allow-config-change`, which applies it from the first resumed step; "fixed" fields
are what the checkpoint's state is made of (the adapter's shape, the optimizer's kind, the backend's
layout, the place in the data): a change is refused either way, saying why; the others (run length,
cadence, reporting) may change.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from lora_tune.errors import UserError, did_you_mean

MATH = {"resume_rule": "math"}  # changing it on resume changes the result: refused unless --allow-config-change (then applied)
FREE = {"resume_rule": "free"}  # run length, cadence, reporting, paths: may change on resume


def fixed(why: str, from_checkpoint: bool = True) -> dict:
    """A setting the checkpoint's state is made of: changing it on --resume is refused, with or
    without --allow-config-change. `why` completes "the checkpoint ..." in the error line and the
    resume table (docs/reference/resume.md); `from_checkpoint`: a new run can start from the checkpoint's adapter
    with the new value (`--init-adapter CHECKPOINT`), which an adapter of another shape can't."""
    return {"resume_rule": "fixed", "resume_why": why, "from_checkpoint": from_checkpoint}


class Options(BaseModel):
    """A section of options, declared in the room that reads them; `section` titles its group in --help."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    section: ClassVar[str] = "options"


def flag(name: str, field=None) -> str:
    """The CLI flag of a field: its name with dashes, unless the field names its own."""
    custom = (getattr(field, "json_schema_extra", None) or {}).get("flag")
    return custom or "--" + name.replace("_", "-")


def read_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file {path} is a folder; pass a YAML file to --config")
    if not p.is_file():
        raise UserError(f"config file {path} does not exist; pass an existing YAML file to --config")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not text (not UTF-8); pass a YAML file to --config") from None
    except OSError as e:
        raise UserError(f"config file {path} is unreadable ({e.strerror or e})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{where}; fix the syntax") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"config file {path} must be a mapping of option: value")
    return loaded


def build_config(schema: type[BaseModel], file_values: dict[str, Any], flag_values: dict[str, Any], source: str = "config") -> BaseModel:
    """Merge defaults < YAML file < CLI flags and validate; every problem becomes a UserError."""
    known = schema.model_fields
    for key in file_values:
        if key not in known:
            raise UserError(f"unknown key '{key}' in {source}{did_you_mean(key, known)}; see --help for the options")
    merged = {**file_values, **flag_values}
    try:
        return schema(**merged)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "missing":
            raise UserError(f"{flag(name)} is required (or `{name}:` in the --config file)") from None
        got = err.get("input")
        field = schema.model_fields.get(name)
        if err["type"] in BOUND_ERRORS and field is not None:
            hint = (field.json_schema_extra or {}).get("hint") or ("leave it out to disable" if field.default is None else None)
            msg = f"must be {bounds(field)} (got {got})" + (f"; {hint}" if hint else "")
        elif err["type"] == "too_short":
            msg = f"give at least one value (got {got!r})"
        elif err["type"] == "literal_error" or "parsing" in err["type"] or err["type"].endswith("_type"):
            msg = f"got {got!r}; {err['msg'].lower()}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        raise UserError(f"{flag(name)}: {msg}") from None


BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def bounds(field) -> str:
    """A field's numeric constraints in words: 'a positive integer', 'in [0, 1)', '> 0', '>= 0'."""
    found = {}
    for m in field.metadata:
        for kind in ("gt", "ge", "lt", "le"):
            if isinstance(m, getattr(annotated_types, kind.capitalize())):
                found[kind] = getattr(m, kind)
    integer = field.annotation is int or int in getattr(field.annotation, "__args__", ())
    if found == {"gt": 0} and integer:
        return "a positive integer"
    low = f"[{found['ge']}" if "ge" in found else f"({found['gt']}" if "gt" in found else None
    high = f"{found['le']}]" if "le" in found else f"{found['lt']})" if "lt" in found else None
    if low and high:
        return f"in {low}, {high}"
    return " and ".join(f"{op} {found[k]}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if k in found)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, option: str, hint: str = "") -> int:
    """'5GB' -> 5_000_000_000, '100MiB' -> 104_857_600. A bare number is refused, not read as bytes:
    people type `24` for 24 GB, and 24 bytes is never what they meant."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if m and not m.group(2):
        raise UserError(f"{option}: {text!r} has no unit; write e.g. {m.group(1)}GB or {m.group(1)}GiB{hint}")
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{option}: {text!r} is not a size; write e.g. 5GB, 500MB or 80GiB{hint}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_text(v):
    """A size given as a number (YAML `gpu_memory: 24`, the API's gpu_memory=24) reaches parse_size,
    which refuses it with the hint, instead of failing as "not a string"."""
    return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
