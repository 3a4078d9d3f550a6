"""What the runner executes: each benchmark's declaration and the notebook that runs it.

A name is looked up in the registry (`benchlib.registry`: the built-ins and entry points); a
notebook that no declaration names (a test fixture, a user's notebook) becomes one from its
`parameters` cell, typed by its defaults, and its `quick` cell. Every name and value is checked
by the declaration before a kernel starts: papermill would inject a typo like `-p repeat=3`
silently and run with the default.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import registry
from benchlib.runner.arguments import RunnerError
from benchlib.benchmark import INJECTED, Benchmark, DeclarationError, Parameter, ParameterError
from benchlib.records.places import find_project_root

# Runs a benchmark declared with `measure` (no notebook of its own) in a kernel like any other.
DECLARED_NOTEBOOK = Path(__file__).with_name("declared.ipynb")


@dataclass(frozen=True)
class NotebookSpec:
    """A benchmark and the notebook file that executes it."""

    benchmark: Benchmark
    path: Path
    has_quick: bool = True  # False: an undeclared notebook without a `quick` cell (--quick refuses it)
    sources: tuple[Path, ...] = ()  # the model file(s) a benchmark was loaded from (the kernel loads them again)
    checked: tuple[tuple[str, str], ...] = ()  # (source, digest of the content the reading child's form check
    # passed): the kernel does not check that content again

    @property
    def name(self) -> str:
        return self.benchmark.name

    @property
    def parameters(self) -> tuple[str, ...]:
        return self.benchmark.names

    def describe_parameters(self) -> str:
        return self.benchmark.describe_parameters()

    def typed(self, name: str, given: Any) -> Any:
        """A value given for parameter `name` as the parameter holds it: text (the command line's) parsed by it, a
        str parameter taking the text as typed; any other value checked by it. A RunnerError says what is valid."""
        try:
            parameter = self.benchmark.parameter(name)
            return parameter.parse(given) if isinstance(given, str) else parameter.check(given)
        except ParameterError as error:
            raise RunnerError(f"{self.name}: {error}") from None

    def notebook_parameters(self, values: Mapping[str, Any], injected: Mapping[str, str]) -> dict[str, Any]:
        """What papermill injects: every declared value (so the notebook runs the declaration's values,
        not its cell's) and device/results_dir; a `measure` benchmark gets its name and values as one dict."""
        config = self.benchmark.config(values).plain()
        if self.path == DECLARED_NOTEBOOK:
            files = [str(source) for source in self.sources]
            benchmark = (files[0] if len(files) == 1 else files) if files else self.benchmark.name
            return {"benchmark": benchmark, "parameters": config, **({"checked": dict(self.checked)} if self.checked
                                                                     else {}), **injected}
        return {**config, **injected}


INSTALLED_NOTEBOOKS = Path("share") / "benchlib" / "notebooks"  # the wheel's data files (pyproject.toml)


def installed_notebooks() -> Path | None:
    """Where an installed copy of benchlib (a wheel, not an editable checkout) keeps its built-in notebooks,
    whatever the scheme: where its install record says, under the environment's prefix, the user base, or
    beside the package (pip --target)."""
    import site
    from importlib import metadata

    candidates = []
    try:
        candidates += [Path(str(file.locate())).parent for file in metadata.files("benchlib") or []
                       if file.suffix == ".ipynb" and INSTALLED_NOTEBOOKS.as_posix() in file.as_posix()][:1]
    except metadata.PackageNotFoundError:
        pass
    candidates += [Path(sys.prefix) / INSTALLED_NOTEBOOKS, Path(site.getuserbase()) / INSTALLED_NOTEBOOKS,
                   Path(__file__).resolve().parents[2] / INSTALLED_NOTEBOOKS]
    return next((folder.resolve() for folder in candidates if any(folder.glob("*.ipynb"))), None)


def find_project_notebooks() -> Path:
    """`notebooks/` of the project containing the working directory, else those of the installed copy, else
    the folder beside the package (a checkout)."""
    project = find_project_root()
    if project is not None:
        return project / "notebooks"
    return installed_notebooks() or Path(__file__).resolve().parents[2] / "notebooks"


def available_notebooks(notebooks_dir: Path) -> dict[str, Path]:
    """Notebook name -> path, the yardsticks' first (`registry.yardsticks`), then alphabetical."""
    if not notebooks_dir.is_dir():
        what = "is a file, not a directory" if notebooks_dir.exists() else "does not exist"
        raise RunnerError(f"notebooks directory {str(notebooks_dir)!r} {what}")
    paths = {path.stem: path for path in sorted(notebooks_dir.glob("*.ipynb"))}
    first = registry.yardsticks(declared())
    return dict(sorted(paths.items(), key=lambda item: (item[0] not in first, item[0])))


def declared() -> dict[str, Benchmark]:
    """The registry's benchmarks; a broken declaration is refused with its module named (exit 2)."""
    try:
        return registry.benchmarks()
    except DeclarationError as error:
        raise RunnerError(str(error)) from None


def declared_notebook(benchmark: Benchmark) -> Path:
    """Where a declared benchmark's notebook is: its own (relative names are in the project's
    notebooks/), or the generic notebook for a `measure` benchmark."""
    if benchmark.notebook is None:
        return DECLARED_NOTEBOOK
    path = Path(benchmark.notebook)
    return path if path.is_absolute() else find_project_notebooks() / path


def _spec(name: str, path: Path) -> NotebookSpec:
    known = declared().get(name)
    return NotebookSpec(known, path.resolve()) if known is not None else notebook_spec(name, path)


def is_model_file(name: str) -> bool:
    """A name `benchlib run` reads as a model file: it ends in .py, names a file that is not a notebook, or is a
    model's name (hf:, tv:, timm:: `benchlib.usermodel.named`)."""
    from benchlib.usermodel.named import is_model_name

    path = Path(name)
    return name.endswith(".py") or (path.is_file() and path.suffix != ".ipynb") or is_model_name(name)


def model_file_specs(groups: Sequence[Sequence[str]]) -> list[NotebookSpec]:
    """Each group of model files (paths ending in .py; several: versions of one NAME) as one benchmark run by
    the generic notebook, every group read and checked in one child process (`benchlib.usermodel.reading`:
    the user's code never runs in the runner's); the first refusal is raised, saying why."""
    from benchlib.records.environment import file_digest
    from benchlib.usermodel.reading import declare_in_child

    for name in (name for group in groups for name in group):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # bytes the file system allowed but no text can carry: records, run.json
            raise RunnerError(f"{os.fsencode(name).decode('utf-8', 'backslashreplace')}: the file name is not valid UTF-8 "
                              "(its bytes name no text: run.json, the records and the report are text); rename "
                              "the file") from None
    specs = []
    digests = {}  # taken before the child reads the files: the content its form check passes
    for name in (name for group in groups for name in group):
        try:
            digests[str(Path(name).expanduser().resolve())] = file_digest(name)
        except OSError:  # the child names what is wrong with the file
            pass
    for group, answer in zip(groups, declare_in_child(groups)):
        if isinstance(answer, Exception):
            raise RunnerError(str(answer)) from answer
        try:
            registry.refuse_declared_name(answer, group[0] if len(group) == 1 else list(group))
        except DeclarationError as error:
            raise RunnerError(str(error)) from error
        sources = tuple(Path(name).expanduser().resolve() for name in group)
        specs.append(NotebookSpec(answer, DECLARED_NOTEBOOK, sources=sources,
                                  checked=tuple((str(source), digests[str(source)]) for source in sources
                                                if str(source) in digests)))
    return specs


def _every_notebook(notebooks_dir: Path | None, folder: Path) -> list[NotebookSpec]:
    """What a run without names runs: the notebooks in `notebooks_dir`, else every declared benchmark and every
    undeclared notebook in `folder` (the project's)."""
    if notebooks_dir:
        return [_spec(name, path) for name, path in available_notebooks(notebooks_dir).items()]
    specs = {name: NotebookSpec(benchmark, declared_notebook(benchmark)) for name, benchmark in declared().items()}
    for name, path in (available_notebooks(folder) if folder.is_dir() else {}).items():
        if name not in specs:
            specs[name] = notebook_spec(name, path)
    if not specs:
        raise RunnerError(f"no benchmarks: nothing declared and no notebooks (*.ipynb) in {str(folder)!r}")
    return list(specs.values())


def select_notebooks(names: Sequence[str], notebooks_dir: Path | None = None) -> list[NotebookSpec]:
    """The benchmarks asked for, or all: every declared benchmark and every undeclared notebook in
    the project's notebooks/ (or, given `notebooks_dir`, the notebooks there).

    A name ending in .py, or naming a file that is not a notebook, is a model file (`benchlib.usermodel`);
    files with the same NAME are versions of one benchmark, measured interleaved in one notebook.
    A name with a path separator, or ending in .ipynb and naming a file, is that very notebook (its
    folder is its working directory; a declared name keeps its declaration); it is never swapped for
    the project's notebook of the same name. A bare name is a declared benchmark, else a notebook
    in `notebooks_dir`.
    """
    folder = notebooks_dir or find_project_notebooks()
    if not names:
        return _every_notebook(notebooks_dir, folder)
    from benchlib.usermodel.named import resolved

    names = [resolved(name) for name in names]  # hf:, tv:, timm: names: the model file each stands for
    selected: dict[str, NotebookSpec] = {}
    unknown = []
    model_files = [name for name in names if is_model_file(name)]
    read = dict(zip(model_files, model_file_specs([[name] for name in model_files]))) if model_files else {}
    versions: dict[str, list[str]] = {}  # NAME -> its files, where several share one
    for name in names:
        path = Path(name)
        if name in read:
            spec = read[name]
            if spec.name in selected and not selected[spec.name].sources:
                raise RunnerError(f"{selected[spec.name].path} and {name} are both named {spec.name!r}; give the "
                                  "file another NAME to run them together")
            if spec.name in selected:  # another version of one benchmark: one spec, measured interleaved
                paths = [*selected[spec.name].sources, *spec.sources]
                if len(set(paths)) < len(paths):
                    raise RunnerError(f"{name} is given twice")
                versions.setdefault(spec.name, [str(source) for source in selected[spec.name].sources]).append(name)
                spec = NotebookSpec(spec.benchmark, spec.path, sources=tuple(paths),
                                    checked=(*selected[spec.name].checked, *spec.checked))
            selected[spec.name] = spec
            continue
        if os.sep in name or (os.altsep and os.altsep in name) or (name.endswith(".ipynb") and path.is_file()):
            if path.suffix != ".ipynb" or not path.is_file():
                raise RunnerError(f"notebook file {name!r} does not exist (a path must name an existing .ipynb file)")
            spec = _spec(path.stem, path)
            if spec.name in selected and selected[spec.name].path != spec.path:
                raise RunnerError(f"two notebooks named {spec.name!r} ({selected[spec.name].path} and {path}); "
                                  "run them separately")
            selected[spec.name] = spec
            continue
        stem = name.removesuffix(".ipynb")
        local = folder / f"{stem}.ipynb"
        if notebooks_dir and local.is_file():
            selected[stem] = _spec(stem, local)
        elif stem in declared():
            selected[stem] = NotebookSpec(declared()[stem], declared_notebook(declared()[stem]))
        elif local.is_file():
            selected[stem] = _spec(stem, local)
        else:
            unknown.append(stem)
    if versions:  # versions of one NAME: read together once more, so the checks between them run too
        for spec in model_file_specs(list(versions.values())):
            selected[spec.name] = spec
    if unknown:
        listing = ", ".join(dict.fromkeys([*declared(), *(available_notebooks(folder) if folder.is_dir() else {})]))
        raise RunnerError(f"unknown benchmark(s): {', '.join(unknown)}; known: {listing or 'none'} "
                          "(or give a path to a .ipynb file, a model file ending in .py, or a model by name: hf:NAME_OR_PATH, "
                          "tv:NAME, timm:NAME)")
    return list(selected.values())


def _literal(source: str) -> tuple[Any, bool]:
    try:
        return ast.literal_eval(source), True
    except (ValueError, SyntaxError):
        return None, False


def _quick_sizes(path: Path) -> dict[str, Any] | None:
    """QUICK from the cell tagged `quick`, which must hold only `QUICK = {...}` (a literal)."""
    import nbformat  # imported where a notebook is read: a second of schema set-up that refusals need not pay

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


def _first_paragraph(path: Path) -> str:
    import nbformat

    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            return re.sub(r"[*`#]", "", cell.source.strip().split("\n\n")[0]).strip()
    return ""


def notebook_spec(name: str, path: Path) -> NotebookSpec:
    """An undeclared notebook as a benchmark: its parameters cell's literal defaults typed by their
    values, its `quick` cell's sizes; refused, saying why, when the runner cannot drive it."""
    from papermill.inspection import _infer_parameters  # inspect_notebook would want kernel metadata
    from papermill.iorw import load_notebook_node

    from benchlib.runner.papermill_exec import KERNEL_NAME, LANGUAGE

    try:
        declared_cell = {parameter.name: parameter._asdict()
                         for parameter in _infer_parameters(load_notebook_node(str(path)), KERNEL_NAME, LANGUAGE)}
    except (OSError, ValueError) as error:  # unreadable, not JSON, not a notebook
        raise RunnerError(f"{path}: not a notebook that can be read ({type(error).__name__}: {error})") from None
    if not declared_cell:
        raise RunnerError(f"{path.name} has no cell tagged 'parameters' (it needs at least {' and '.join(INJECTED)})")
    missing = [injected for injected in INJECTED if injected not in declared_cell]
    if missing:
        raise RunnerError(f"{path.name}: its parameters cell must define {', '.join(missing)} (the runner injects them)")
    quick_cell = _quick_sizes(path)
    quick = quick_cell or {}
    parameters = []
    for parameter_name, info in declared_cell.items():
        if parameter_name in INJECTED:
            continue
        default, literal = _literal(info["default"])
        try:
            parameters.append(Parameter(parameter_name, default, "(from the notebook's parameters cell)",
                                        **({"quick": quick[parameter_name]} if parameter_name in quick else {})))
        except (DeclarationError, ParameterError) as error:
            what = "is not a literal" if not literal else f"cannot be typed ({error})"
            raise RunnerError(f"{path.name}: parameter {parameter_name} = {info['default']} {what}; give it an int, "
                              "float, bool, str or non-empty list default (or declare the benchmark)") from None
    unknown = sorted(set(quick) - {p.name for p in parameters})
    if unknown:
        raise RunnerError(f"{path.name}: its QUICK sizes are wrong: no parameter(s) {unknown}")
    try:
        benchmark = Benchmark(name=name, question=_first_paragraph(path) or f"(the notebook {path.name})",
                              parameters=tuple(parameters), notebook=str(path.resolve()))
    except DeclarationError as error:
        raise RunnerError(f"{path.name}: {error}") from None
    return NotebookSpec(benchmark, path.resolve(), has_quick=quick_cell is not None)
