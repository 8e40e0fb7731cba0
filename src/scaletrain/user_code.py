"""The user's own code, named by import path: `package.module:function`.

`model.name`, `data.source` and `train.loss` accept an import path besides their built-in
names. This module is the one place such a path becomes an object and the one place the
user's code is called, so every way it can go wrong reads the same:

- a path that is not `module:attribute`, a module that does not import, an attribute it
  lacks, an object that is not callable: refused with the config key and the path named;
- a call that raises: the exception's type and message, and the line of the user's own
  file it came from (the innermost frame outside scaletrain and torch), no traceback (the
  original exception is the error's __cause__: `--debug` and the Python API show it);
- a result of the wrong kind is the caller's check (it knows what it wanted).

Imports resolve the same way in the launcher and on every rank: the working directory is
put first on `sys.path` (as `python -m` does for the workers), and PYTHONPATH is inherited
by the workers from the launcher's environment. The Python API adds the directory a
callable's module was imported from (`pythonpath_for`).

Callables given to the Python API need a name the workers can import: `import_path_of`
refuses lambdas, functions defined inside functions and anything in `__main__` (a script
or a notebook), saying where to move them.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_LIBRARIES = ("torch", "transformers", "importlib")  # frames of theirs are not the user's
# The Python API's argument for each config key a callable stands for (api.train).
_API_ARGUMENT = {"model.name": "model", "data.source": "data", "train.loss": "loss"}


class UserCodeError(UserError):
    """The user's code named in the config could not be imported, or raised, or returned
    the wrong thing; shown as one line like any config mistake (exit status 2)."""


def is_import_path(value: str) -> bool:
    """True for `package.module:function` (dotted names on both sides of one colon)."""
    return bool(_IMPORT_PATH.match(value))


def load_object(path: str, *, key: str) -> Any:
    """Import `module:attribute` and return the attribute.

    Args:
        path: the import path, e.g. "mymodels.nets:build".
        key: the config key that named it, for the message (e.g. "model.name").

    Raises:
        UserCodeError: naming the key, the path and what went wrong.
    """
    if not is_import_path(path):
        raise UserCodeError(
            f"{key} = {path!r} is not an import path: write "
            "'package.module:function' (e.g. 'mymodels.nets:build')"
        )
    module_name, attr = path.split(":")
    _working_directory_first()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UserCodeError(
                f"{key} = {path!r}: no module named {e.name!r} (searched the working "
                f"directory {os.getcwd()} and PYTHONPATH "
                f"{os.environ.get('PYTHONPATH') or '(unset)'})"
            ) from None
        raise UserCodeError(
            f"{key} = {path!r}: importing {module_name!r} failed: {describe_error(e)}"
        ) from e
    except Exception as e:  # the module's own code raised while importing
        raise UserCodeError(
            f"{key} = {path!r}: importing {module_name!r} failed: {describe_error(e)}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(
                n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))
            )[:12]
            raise UserCodeError(
                f"{key} = {path!r}: module {module_name!r} "
                f"({getattr(module, '__file__', '?')}) has no attribute "
                f"{attr!r}; its callables: {', '.join(public) or 'none'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserCodeError(
            f"{key} = {path!r} is a {type(obj).__name__}, not a function or class to call"
        )
    return obj


def call(fn: Callable, *args: Any, key: str, path: str, **kwargs: Any) -> Any:
    """Call the user's `fn`; an exception it raises becomes a UserCodeError naming the path.

    Args:
        fn: the user's callable.
        *args, **kwargs: passed through.
        key, path: the config key and value that named it (for the message).
    """
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        if _raised_by_the_call(e):  # the signature does not fit what scaletrain passes
            raise UserCodeError(
                f"{key} = {path!r} cannot be called as scaletrain calls it: {e}"
            ) from e
        raise UserCodeError(f"{key} = {path!r} raised {describe_error(e)}") from e
    except Exception as e:
        raise UserCodeError(f"{key} = {path!r} raised {describe_error(e)}") from e


def _raised_by_the_call(error: TypeError) -> bool:
    """A TypeError from binding the arguments has no frame inside the called function."""
    return len(traceback.extract_tb(error.__traceback__)) <= 1


def describe_error(error: BaseException) -> str:
    """`Type: message (at file:line)`, the line in the user's code nearest the error."""
    where = ""
    libraries = _library_dirs()
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
            continue
        if not os.path.realpath(frame.filename).startswith(libraries):
            where = f" (at {frame.filename}:{frame.lineno})"
            break
    if isinstance(error, SyntaxError) and error.filename:
        where = f" (at {error.filename}:{error.lineno})"
    message = str(error).splitlines()[0] if str(error) else ""
    return (
        f"{type(error).__name__}: {message}{where}" if message else f"{type(error).__name__}{where}"
    )


def _library_dirs() -> tuple[str, ...]:
    """Where scaletrain and the libraries it calls through are installed (real paths), so
    that a user's project in a directory that happens to be called `torch` is still theirs."""
    dirs = [os.path.dirname(os.path.realpath(__file__))]
    for name in _LIBRARIES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.realpath(file)))
    return tuple(d + os.sep for d in dirs)


def _working_directory_first() -> None:
    """Import from the working directory as `python -m` does (a console script does not)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_path_of(obj: Callable, *, key: str) -> str:
    """The `module:qualname` path the workers can import `obj` by.

    Args:
        obj: a function or class given to the Python API.
        key: the config key it stands for (for the message).

    Raises:
        UserCodeError: a lambda, a local function, or one defined in `__main__`.
    """
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    label = qualname or repr(obj)
    if not module or not qualname or "<" in qualname:
        raise UserCodeError(
            f"{key}: {label} has no importable name (a lambda or a function defined inside "
            "another); worker processes import it by name: define it at the top level of a "
            "module and pass that, or run with one process"
        )
    if module == "__main__":
        # Both forms the hint names are accepted: the callable imported from its module, or
        # its import path `module:qualname` as the config key's value.
        argument = _API_ARGUMENT.get(key, key.split(".")[0])
        raise UserCodeError(
            f"{key}: {qualname} is defined in __main__ (a script or a notebook), which worker "
            f"processes cannot import: move it into a module next to it (e.g. mycode.py), then "
            f"pass it from there (`from mycode import {qualname.split('.')[0]}`, "
            f"{argument}={qualname}) or name it in the config ({key} = 'mycode:{qualname}'), "
            "or run with one process"
        )
    path = f"{module}:{qualname}"
    if load_object(path, key=key) is not obj:
        raise UserCodeError(
            f"{key}: importing {path!r} gives a different object than the one "
            "passed; pass a module-level function or class"
        )
    return path


def pythonpath_for(obj: Callable) -> str | None:
    """The directory `obj`'s top-level package was imported from, for the workers' PYTHONPATH."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    for _ in range(obj.__module__.count(".")):  # a.b.c lives in ROOT/a/b/c.py
        root = root.parent
    return str(root)
