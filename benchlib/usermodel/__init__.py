"""A user's own model, in one Python file, as a `benchlib.Benchmark` (`benchlib run my_model.py`).

`load_model_file(path)` reads the file in either form (the torch form, `benchlib.usermodel.loader`;
the array form, `benchlib.usermodel.arrays`), types its PARAMETERS by their defaults, and, before
anything is measured, builds its pieces at the QUICK values (small, so cheap) and calls loss once:
a loss that returns a non-scalar is refused there, not in the middle of a run. The benchmark it
returns measures every engine of the form in fresh processes (`benchlib.usermodel.measuring`).
"""

from __future__ import annotations

from benchlib.lazy_exports import lazy_exports

# Public names and the module that holds each: imported when first asked for, so that a process that
# only plans (the runner refusing a bad file, `usermodel.reading`'s parent side) never imports torch.
_HOMES = {
    "ModelFileError": "loader",
    "read_model_file": "loader",
    "declaration": "declare",
    "declare_model_files": "declare",
    "load_model_file": "declare",
    "load_model_files": "declare",
    "version_labels": "declare",
}

__getattr__ = lazy_exports(__name__, _HOMES)


__all__ = sorted(_HOMES)
