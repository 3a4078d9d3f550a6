"""Finding notebooks and reading their parameters, so bad input is refused before a kernel starts.

papermill injects any name it is given, silently: a typo like `-p repeat=3` would run with the
default and look like a result. Here every name and type is checked against the notebook's
`parameters` cell, and `--quick` sizes come from the notebook's own `quick` cell.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import papermill

from benchlib.results.store import find_project_root

FIRST_NOTEBOOK = "calibration"  # the ceilings the others compare against: run it first
INJECTED = ("device", "results_dir")  # set by the runner from --device and the run directory
_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict", type(None): "None"}


class RunnerError(ValueError):
    """Input the runner refuses before anything runs; the message says what is valid."""


@dataclass(frozen=True)
class Parameter:
    """One name of a notebook's `parameters` cell: its default's source text and its value when literal."""

    name: str
    source: str
    default: Any
    literal: bool

    @property
    def type_name(self) -> str:
        """The type a value must have; 'any' when the default is None or not a literal."""
        if not self.literal or self.default is None:
            return "any"
        return _TYPE_NAMES.get(type(self.default), type(self.default).__name__)

    def describe(self) -> str:
        return f"{self.name}: {self.type_name} = {self.source}"


@dataclass(frozen=True)
class NotebookSpec:
    """A notebook with the parameters it declares and its QUICK sizes (None when it has no `quick` cell)."""

    name: str
    path: Path
    parameters: dict[str, Parameter] = field(default_factory=dict)
    quick: dict[str, Any] | None = None

    def describe_parameters(self) -> str:
        return "\n".join(f"  {parameter.describe()}" for parameter in self.parameters.values())


def find_project_notebooks() -> Path:
    """`notebooks/` of the project containing the working directory, else the one beside the package."""
    project = find_project_root()
    return (project or Path(__file__).resolve().parents[2]) / "notebooks"


def available_notebooks(notebooks_dir: Path) -> dict[str, Path]:
    """Notebook name -> path, calibration first, then alphabetical."""
    if not notebooks_dir.is_dir():
        raise RunnerError(f"notebooks directory {str(notebooks_dir)!r} does not exist")
    paths = {path.stem: path for path in sorted(notebooks_dir.glob("*.ipynb"))}
    return dict(sorted(paths.items(), key=lambda item: (item[0] != FIRST_NOTEBOOK, item[0])))


def select_notebooks(names: Sequence[str], notebooks_dir: Path) -> dict[str, Path]:
    """The notebooks asked for, or all of them in `notebooks_dir`.

    A name with a path separator is a file: that very file runs (its folder is its working
    directory), or it is refused when missing; it is never swapped for the project's notebook of
    the same name. A bare name (with or without .ipynb) is looked up in `notebooks_dir`.
    """
    if not names:
        available = available_notebooks(notebooks_dir)
        if not available:
            raise RunnerError(f"no notebooks (*.ipynb) in {str(notebooks_dir)!r}")
        return available
    selected: dict[str, Path] = {}
    unknown = []
    for name in names:
        if os.sep in name or (os.altsep and os.altsep in name):
            path = Path(name)
            if path.suffix != ".ipynb" or not path.is_file():
                raise RunnerError(f"notebook file {name!r} does not exist (a path must name an existing .ipynb file)")
            stem = path.stem
            if stem in selected and selected[stem] != path.resolve():
                raise RunnerError(f"two notebooks named {stem!r} ({selected[stem]} and {path}); run them separately")
            selected[stem] = path.resolve()
            continue
        available = available_notebooks(notebooks_dir)
        stem = name.removesuffix(".ipynb")
        if stem not in available:
            unknown.append(stem)
        else:
            selected[stem] = available[stem]
    if unknown:
        listing = ", ".join(available_notebooks(notebooks_dir)) or "none"
        raise RunnerError(f"unknown notebook(s): {', '.join(unknown)}; notebooks in {notebooks_dir}: {listing} "
                          "(or give a path to a .ipynb file)")
    return selected


def _literal(source: str) -> tuple[Any, bool]:
    try:
        return ast.literal_eval(source), True
    except (ValueError, SyntaxError):
        return None, False


def _quick_sizes(path: Path) -> dict[str, Any] | None:
    """QUICK from the cell tagged `quick`, which must hold only `QUICK = {...}` (a literal)."""
    notebook = nbformat.read(path, as_version=4)
    cells = [cell for cell in notebook.cells if "quick" in cell.get("metadata", {}).get("tags", [])]
    if not cells:
        return None
    if len(cells) > 1:
        raise RunnerError(f"{path.name}: {len(cells)} cells are tagged 'quick'; tag exactly one, holding QUICK = {{...}}")
    try:
        tree = ast.parse(cells[0].source)
        (statement,) = tree.body
        if not (isinstance(statement, ast.Assign) and [getattr(t, "id", None) for t in statement.targets] == ["QUICK"]):
            raise ValueError
        quick = ast.literal_eval(statement.value)
        if not isinstance(quick, dict):
            raise ValueError
    except (SyntaxError, ValueError):
        raise RunnerError(
            f"{path.name}: the cell tagged 'quick' must hold exactly one statement, QUICK = {{...}} (a dict literal)"
        ) from None
    return quick


def inspect(name: str, path: Path) -> NotebookSpec:
    """Read a notebook's parameters (papermill's inspection) and QUICK sizes; refuse it if the runner cannot drive it."""
    declared = papermill.inspect_notebook(str(path))
    if not declared:
        raise RunnerError(f"{path.name} has no cell tagged 'parameters' (it needs at least {' and '.join(INJECTED)})")
    parameters = {}
    for parameter_name, info in declared.items():
        value, literal = _literal(info["default"])
        parameters[parameter_name] = Parameter(parameter_name, info["default"], value, literal)
    missing = [name for name in INJECTED if name not in parameters]
    if missing:
        raise RunnerError(f"{path.name}: its parameters cell must define {', '.join(missing)} (the runner injects them)")
    spec = NotebookSpec(name, path, parameters, _quick_sizes(path))
    if spec.quick is not None:
        for key, value in spec.quick.items():
            try:
                check_value(spec, key, value)
            except RunnerError as error:
                raise RunnerError(f"{path.name}: its QUICK sizes are wrong: {error}") from None
    return spec


def parse_value(text: str) -> Any:
    """A `-p` value: a Python literal where it is one (10, 1e-3, True, None, [1, 2], {'a': 1}), else the text."""
    value, literal = _literal(text)
    return value if literal else text


def parse_assignment(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` from the command line."""
    name, equals, value = text.partition("=")
    if not equals or not name.strip().isidentifier():
        raise RunnerError(f"-p takes NAME=VALUE (e.g. -p repeats=3 or -p engines='[\"torch\"]'), got {text!r}")
    return name.strip(), value


def check_value(spec: NotebookSpec, name: str, value: Any) -> Any:
    """`value` converted for parameter `name` of `spec` (int -> float, tuple -> list), or a RunnerError."""
    if name not in spec.parameters:
        raise RunnerError(f"{spec.name} has no parameter {name!r}; its parameters are:\n{spec.describe_parameters()}")
    parameter = spec.parameters[name]
    expected = parameter.type_name
    if expected == "any":
        return value
    if expected == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected == "list" and isinstance(value, tuple):
        return list(value)
    if type(value).__name__ != expected and not (expected == "None" and value is None):
        raise RunnerError(
            f"{spec.name}: parameter {name} takes {'an' if expected[0] in 'aeiou' else 'a'} {expected} "
            f"(default {parameter.source}), "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def coerce_text(spec: NotebookSpec, name: str, text: str) -> Any:
    """A command-line value for `name`: a str parameter takes the text as typed; others parse it as a literal."""
    parameter = spec.parameters.get(name)
    value = parse_value(text)
    if parameter is not None and parameter.type_name == "str" and not isinstance(value, str):
        value = text
    return check_value(spec, name, value)
