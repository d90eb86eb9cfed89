"""Users' own code that a run calls: reward functions, tools, environment classes, named as
`path/to/file.py:name` or `package.module:name`. A file runs once per run as a module of its own (its
folder on sys.path only while it runs), compiled from the bytes that are hashed, so a fingerprint
identifies the code that runs; every problem finding the name is one UserError naming the spec."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import itertools
import os
import sys
import traceback
from functools import partial
from pathlib import Path

from lora_tune.errors import UserError, did_you_mean, first_line

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # lora_tune's own frames, dropped from users' tracebacks
_module_numbers = itertools.count()  # a file loaded twice runs twice, each time under its own module name


def ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(PACKAGE)


def resolve(spec: str, flag: str, modules: dict, what: str = "function") -> tuple[object, str, str]:
    """(the object `spec` names, how errors name it: "FLAG SPEC", its identity for a fingerprint).
    `what`: "function" or "class", for the messages; `modules`: files already run by this run."""
    culprit = f"{flag} {spec}"
    word = "func" if what == "function" else "Class"
    target, colon, attr = spec.rpartition(":")
    if not colon or not target:
        raise UserError(f"{culprit}: name the {what} after a colon, as path/to/file.py:{word} or package.module:{word}")
    if not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise UserError(
            f"{culprit}: {attr!r} after the colon is not a Python {what} name; write file.py:{word} ({word} as in `"
            f"{'def' if what == 'function' else 'class'} {word}`)"
        )
    is_file = target.endswith(".py") or target.startswith(("~", ".")) or "/" in target or os.sep in target or Path(target).is_file()
    if is_file:
        prefix = "lora_tune_" + flag.strip("-").replace("-", "_")
        module, digest = load_file(target, culprit, modules, prefix)
        identity = f"{Path(target).name}:{attr}@sha256:{digest}"
    else:
        if not all(part.isidentifier() for part in target.split(".")):
            raise UserError(
                f"{culprit}: {target!r} is neither a .py file nor a module name; write path/to/file.py:{word} or package.module:{word}"
            )
        module = load_module(target, attr, culprit)
    obj = module
    test = inspect.isfunction if what == "function" else inspect.isclass
    for part in attr.split("."):
        if not hasattr(obj, part):
            own = [n for n, v in vars(module).items() if test(v) and v.__module__ == module.__name__ and n[:1] != "_"]
            listed = ", ".join(own[:10]) + (", ..." if len(own) > 10 else "") if own else "none"
            plural = "functions" if what == "function" else "classes"
            raise UserError(f"{culprit}: {target} has no {what} {attr}{did_you_mean(attr, own)}; the {plural} it defines: {listed}")
        obj = getattr(obj, part)
    return obj, culprit, identity if is_file else f"{target}:{attr}{file_hashes(module, obj)}"


def kind(value) -> str:
    """'a list', 'a Tensor of shape (4, 1)': what a function returned, for its error line."""
    name = type(value).__name__
    shape = getattr(value, "shape", None)
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def callable_name(func) -> str:
    """TRL's get_callable_name: a partial's wrapped function's __name__, else the class name."""
    while isinstance(func, partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def user_traceback(error: BaseException) -> str:
    """The exception's traceback from the user's function down: lora-tune's frames (the call into
    it) are dropped, so what is printed is all theirs."""
    te = traceback.TracebackException.from_exception(error)
    frames = list(te.stack)
    while frames and ours(frames[0].filename):
        frames.pop(0)
    te.stack = traceback.StackSummary.from_list(frames)
    return "".join(te.format())


def load_file(target: str, culprit: str, modules: dict, prefix: str = "lora_tune_user") -> tuple[object, str]:
    """Runs the file as a module of its own (a unique name, its folder on sys.path only while it
    runs, so it can import its neighbours); compiled from the bytes that are hashed, so the
    fingerprint is of the code that runs, and no bytecode is written beside it."""
    path = Path(target).expanduser().absolute()
    if not path.exists():
        raise UserError(f"{culprit}: no file {path}; give the path of your .py file, relative to the current directory or absolute")
    if path.is_dir() or path.suffix != ".py":
        raise UserError(f"{culprit}: {target} is {'a folder' if path.is_dir() else 'not a .py file'}; give the path of a .py file")
    try:
        source = path.read_bytes()
    except OSError as e:
        raise UserError(f"{culprit}: can't read {target} ({e.strerror or e}); check its permissions") from None
    digest = hashlib.sha256(source).hexdigest()
    if path in modules:
        return modules[path], digest
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"{prefix}_{next(_module_numbers)}_{stem}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module  # dataclasses and pickling look their module up there while it runs
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)  # the user's own file
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise UserError(f"{culprit}: importing {target} raised {import_failure(e, str(path))}") from None
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    modules[path] = module
    return module, digest


def load_module(target: str, attr: str, culprit: str):
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            as_file = target.replace(".", "/") + ".py"
            hint = f" (did you mean {as_file}:{attr}?)" if Path(as_file).is_file() else ""
            raise UserError(
                f"{culprit}: no module named {e.name} on the Python path{hint}; give the file instead (path/to/file.py:{attr}) or "
                "install the module"
            ) from None
        raise UserError(f"{culprit}: importing {target} raised {import_failure(e, None)}") from None
    except (Exception, SystemExit) as e:
        raise UserError(f"{culprit}: importing {target} raised {import_failure(e, None)}") from None
    return module


def import_failure(error: BaseException, path: str | None) -> str:
    """'NameError: name 'x' is not defined (line 3)': the error and where in the user's file
    (`path`; for a module, the deepest frame outside the import machinery, with its file's name)."""
    if isinstance(error, SyntaxError):
        message, filename, line = error.msg, error.filename, error.lineno
    else:
        message = first_line(error)
        frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<") and not ours(f.filename)]
        if path is not None:
            frames = [f for f in frames if f.filename == path] or frames
        filename, line = (frames[-1].filename, frames[-1].lineno) if frames else (None, None)
    if line is None:
        return f"{type(error).__name__}: {message}"
    where = f"line {line}" if path is not None and filename == path else f"{Path(filename or '?').name}, line {line}"
    return f"{type(error).__name__}: {message} ({where})"


def file_hashes(module, func) -> str:
    """A module's file, and the function's own when it is defined elsewhere, hashed."""
    files = []
    for obj in (module, func):
        try:
            f = inspect.getsourcefile(obj) or getattr(obj, "__file__", None)
        except TypeError:
            f = None
        if f and os.path.isfile(f) and f not in files:
            files.append(f)
    return "".join(f"@sha256:{hashlib.sha256(Path(f).read_bytes()).hexdigest()}" for f in files)


def source_identity(func) -> str:
    """A callable's qualified name and the hash of its source text, when Python can find it."""
    inner = func
    while isinstance(inner, partial):
        inner = inner.func
    if not (inspect.isfunction(inner) or inspect.ismethod(inner)):
        inner = type(inner)  # a callable instance: its class's source
    name = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', callable_name(inner))}"
    try:
        return f"{name}@sha256:{hashlib.sha256(inspect.getsource(inner).encode()).hexdigest()}"
    except (OSError, TypeError):
        return name
