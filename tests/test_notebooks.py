"""Every notebook is thin, committed without outputs, and mirrors its workload config's defaults."""
import nbformat
import pytest

from benchlib.runner.notebooks import INJECTED, available_notebooks, find_project_notebooks, inspect
from benchlib.workloads.parameters import CONFIGS, DotChainConfig, ParameterError, validate_parameters

NOTEBOOKS = available_notebooks(find_project_notebooks())


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_every_notebook_has_a_config_whose_defaults_its_parameters_cell_mirrors(name):
    assert name in CONFIGS, f"{name}.ipynb has no config in benchlib.workloads.parameters.CONFIGS"
    spec = inspect(name, NOTEBOOKS[name])
    cell = {key: _plain(p.default) for key, p in spec.parameters.items() if key not in INJECTED}
    config = {key: _plain(value) for key, value in vars(CONFIGS[name]()).items()}
    assert cell == config


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_is_thin_and_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS[name], as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "parameters" in code[0].metadata["tags"] and "quick" in code[1].metadata["tags"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    # thin: at most 50 lines of calls, tables and figures; the parameters and quick cells only declare values
    assert sum(len([line for line in cell.source.splitlines() if line.strip()]) for cell in code[2:]) <= 50


def test_a_config_refuses_a_bad_value_naming_it_and_what_is_valid():
    with pytest.raises(ParameterError, match="dot_chain: dtype must be one of float32, float64, got 'float16'"):
        DotChainConfig(dtype="float16")
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['Depth'\]; valid: D, depth"):
        validate_parameters("dot_chain", {"Depth": 3})
    assert validate_parameters("dot_chain", {"device": "cpu", "results_dir": "", "depth": 3}).depth == 3
    assert validate_parameters("not_a_workload_notebook", {"x": 1}) is None
