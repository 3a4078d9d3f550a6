"""Where runs go, and when they started, without reading one: the results root (`default_results_root`, `$BENCHLIB_RESULTS`), the project a
working directory belongs to, and the refusal of an `--out` that cannot hold runs. Imports no pandas, so a command
refuses a bad `--out` (or anything else) in the time Python takes to start."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from benchlib.errors import Refused

RUN_INFO = "run.json"  # the file that makes a directory a run
RESULTS_ROOT_ENV = "BENCHLIB_RESULTS"


def default_results_root() -> Path:
    """`$BENCHLIB_RESULTS`, else `results/` of the project containing the working directory, else
    `results/` of the project this package was installed from (an editable install), else `./results`.

    JupyterLab starts kernels in `notebooks/`, the runner in the project root: both find the
    same `results/` by walking up to the directory that holds `pyproject.toml` and `notebooks/`;
    from anywhere else the project the package lives in is used.
    """
    if os.environ.get(RESULTS_ROOT_ENV):
        return Path(os.environ[RESULTS_ROOT_ENV])
    project = find_project_root() or find_project_root(Path(__file__).resolve().parent)
    return (project or Path.cwd().resolve()) / "results"


class OutDirRefused(Refused):
    """A root for runs (`--out`) that cannot hold them, said before anything runs."""


def check_out_dir(root: Path) -> None:
    """Refuse a root for runs that cannot be created or written, or that lies inside a run, before anything runs."""
    existing = root
    while not existing.exists():
        if existing.is_symlink():  # mkdir would say only "File exists"
            raise OutDirRefused(f"--out {str(root)!r}: {str(existing)!r} is a symbolic link to "
                                f"{os.readlink(existing)!r}, which does not exist; create its target or give another "
                                "directory")
        existing = existing.parent
    if not existing.is_dir():
        raise OutDirRefused(f"--out {str(root)!r} cannot be created: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutDirRefused(f"--out {str(root)!r} is not writable ({str(existing)!r} refuses writes); choose a "
                            "directory you can write")
    for directory in (root.resolve(), *root.resolve().parents):
        if (directory / RUN_INFO).is_file():
            raise OutDirRefused(f"--out {str(root)!r} is inside the run {str(directory)!r}; runs are not nested: "
                                f"give the directory that holds runs (e.g. {str(directory.parent)!r})")


def find_project_root(start: Path | None = None) -> Path | None:
    """The nearest directory, from `start` (default: the working directory) up, holding `pyproject.toml` and `notebooks/`."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / "pyproject.toml").is_file() and (directory / "notebooks").is_dir():
            return directory
    return None


def now_iso() -> str:
    """UTC time, to the second, in ISO 8601: what run.json records."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
