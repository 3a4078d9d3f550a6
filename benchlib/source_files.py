"""Where a line of code lives, as a reader finds it: whether a frame's file is the user's own code or a
library's (Python's, an installed package's, benchlib's), and a short name for it. Imports nothing of
benchlib, so the instrument (`benchlib.measure`) and the records (`benchlib.records`) both use it."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

_BENCHLIB = str(Path(__file__).resolve().parent)  # the package's folder
_LIBRARY_ROOTS = tuple({str(Path(sysconfig.get_paths()[name]).resolve())
                         for name in ("stdlib", "platstdlib", "purelib", "platlib")} | {_BENCHLIB})


def is_library(filename: str) -> bool:
    """Whether a frame's file is Python's, an installed package's or benchlib's (not the user's code)."""
    if not filename or filename.startswith("<"):
        return True
    return str(Path(filename).resolve()).startswith(_LIBRARY_ROOTS)


def short_path(file: str) -> str:
    """A library's module path from its package (torch/autograd/graph.py, benchlib/autodiff/core.py), else
    the file's name."""
    parts = Path(file).parts
    inside = max((index for index, part in enumerate(parts) if part in ("site-packages", "dist-packages")),
                 default=None)
    if inside is not None:
        return "/".join(parts[inside + 1:])
    if file.startswith(_BENCHLIB + os.sep):
        return Path(file).relative_to(Path(_BENCHLIB).parent).as_posix()
    return Path(file).name
