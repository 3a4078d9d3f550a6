"""Every notebook is declared, thin, committed without outputs, and runs its declaration's values."""
import ast

import nbformat
import papermill
import pytest

from benchlib.benchmark import INJECTED, QUICK_SWITCH, ParameterError
from benchlib.registry import benchmarks, get
from benchlib.runner.notebooks import NotebookSpec, available_notebooks, declared_notebook, find_project_notebooks

NOTEBOOKS = available_notebooks(find_project_notebooks())


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_every_notebook_is_declared_and_runs_the_declarations_values(name):
    assert name in benchmarks(), f"{name}.ipynb: no module of benchlib/workloads declares a BENCHMARK of that name"
    declaration = get(name)
    assert declared_notebook(declaration).resolve() == NOTEBOOKS[name].resolve()
    # the committed cell holds what the runner injects and, where a JupyterLab user must set one (your_model's
    # model_file), a declared parameter at its declared default: every default lives in the declaration
    cell = papermill.inspect_notebook(str(NOTEBOOKS[name]))
    assert set(INJECTED) <= set(cell)
    assert QUICK_SWITCH in cell and ast.literal_eval(cell[QUICK_SWITCH]["default"]) is False
    for parameter in set(cell) - set(INJECTED) - {QUICK_SWITCH}:
        assert ast.literal_eval(cell[parameter]["default"]) == declaration.parameter(parameter).default, parameter
    spec = NotebookSpec(declaration, NOTEBOOKS[name])
    injected = spec.notebook_parameters({}, {"device": "cpu", "results_dir": "/r"})
    assert injected == {**declaration.config().plain(), "device": "cpu", "results_dir": "/r"}
    source = "\n".join(cell.source for cell in nbformat.read(NOTEBOOKS[name], as_version=4).cells)
    assert ".BENCHMARK.config_from(globals())" in source


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_is_thin_and_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS[name], as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "parameters" in code[0].metadata["tags"]
    assert not any("quick" in cell.metadata.get("tags", []) for cell in code), "quick values live in the declaration"
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    # thin: at most 50 lines of code, every cell but the parameters cell counted
    assert sum(len([line for line in cell.source.splitlines() if line.strip()]) for cell in code[1:]) <= 50


def test_no_code_cell_is_repeated_across_notebooks():
    seen: dict[str, str] = {}
    for name, path in NOTEBOOKS.items():
        for cell in nbformat.read(path, as_version=4).cells:
            source = cell.source.strip()
            if cell.cell_type == "code" and "parameters" not in cell.metadata.get("tags", []) and source \
                    and "finish_notebook(" not in source:  # every notebook ends its own run alike
                assert source not in seen, f"{name} repeats a cell of {seen.get(source)}"
                seen[source] = name


def test_a_declaration_refuses_a_bad_value_naming_it_and_what_is_valid():
    with pytest.raises(ParameterError, match="dot_chain: dtype must be one of float32, float64, got 'float16'"):
        get("dot_chain").config({"dtype": "float16"})
    with pytest.raises(ParameterError, match=r"unknown parameter 'Depth' \(did you mean 'depth'\?\); valid parameters:\ndot_chain:\n  D: int"):
        get("dot_chain").config({"Depth": 3})
    assert get("dot_chain").config({"device": "cpu", "results_dir": "", "depth": 3}).depth == 3
    assert set(INJECTED) == {"device", "results_dir"}


def _kernel_namespace(parameters_cell: str, **leftovers) -> dict:
    """What a kernel's globals() hold at the config cell: the parameters cell run (IPython's `In`
    keeps it), its values, and whatever earlier runs of other cells left behind."""
    namespace = dict(leftovers)
    exec(parameters_cell, namespace)
    namespace["In"] = ["", "print('an earlier cell')", parameters_cell, "config = BENCHMARK.config_from(globals())"]
    return namespace


def test_quick_true_in_the_parameters_cell_starts_from_the_declared_quick_values():
    declaration = get("dot_chain")
    cell = 'device = "auto"\nresults_dir = ""\nquick = True\nD = 100'
    # depth = 999 was set by an earlier version of the cell, since deleted: it must not be read
    config = declaration.config_from(_kernel_namespace(cell, depth=999))
    assert config.D == 100  # the cell's own value wins over the quick one
    assert config.depth == declaration.quick["depth"] and config.trials == declaration.quick["trials"]
    plain = declaration.config_from(_kernel_namespace('device = "auto"\nresults_dir = ""\nquick = False'))
    assert plain == declaration.config()


def test_a_name_the_parameters_cell_assigns_that_is_not_declared_is_refused_like_the_runner_does():
    cell = 'device = "auto"\nresults_dir = ""\nquick = True\ndept = 8'
    with pytest.raises(ParameterError, match=r"unknown parameter 'dept' \(did you mean 'depth'\?\); valid parameters:\n"
                                             r"dot_chain:\n  D: int = 1000"):
        get("dot_chain").config_from(_kernel_namespace(cell))
    # papermill's injected cell comes after the committed one: it is the one read
    injected = 'device = "cpu"\nresults_dir = "/r"\ndepth = 3'
    namespace = _kernel_namespace(cell)
    exec(injected, namespace)
    namespace["In"].insert(-1, injected)
    assert get("dot_chain").config_from(namespace).depth == 3


def test_outside_a_kernel_every_declared_name_in_the_namespace_is_read():
    assert get("dot_chain").config_from({"depth": 3, "pd": object()}).depth == 3


def test_the_parameters_cell_is_read_as_python_assigns_it():
    declaration = get("dot_chain")
    # tuple and augmented assignments count; a quick switch deleted from the cell is not read from a leftover
    namespace = _kernel_namespace('device = "auto"\nresults_dir = ""\nD, depth = 32, 3\ndepth += 1', quick=True)
    config = declaration.config_from(namespace)
    assert (config.D, config.depth, config.trials) == (32, 4, declaration.defaults()["trials"])
    assert not config.at_quick_values
    # one cell that is both the parameters and the config cell: what follows config_from is no parameter
    merged = 'device = "auto"\nresults_dir = ""\nquick = True\nconfig = BENCHMARK.config_from(globals())\nlater = 1'
    namespace = {"config": "left from an earlier run"}
    exec(merged.split("\nconfig")[0], namespace)
    namespace["In"] = ["", merged]
    config = declaration.config_from(namespace)
    assert config.at_quick_values and config.depth == declaration.quick["depth"]
    with pytest.raises(ParameterError, match="quick must be True or False, got 'no'"):
        declaration.config_from(_kernel_namespace('device = "auto"\nresults_dir = ""\nquick = "no"'))
