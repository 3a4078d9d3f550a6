"""Each notebook's parameters cell mirrors its workload config, and the config is where values are refused."""
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


def test_a_config_refuses_a_bad_value_naming_it_and_what_is_valid():
    with pytest.raises(ParameterError, match="dot_chain: dtype must be one of float32, float64, got 'float16'"):
        DotChainConfig(dtype="float16")
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['Depth'\]; valid: D, depth"):
        validate_parameters("dot_chain", {"Depth": 3})
    assert validate_parameters("dot_chain", {"device": "cpu", "results_dir": "", "depth": 3}).depth == 3
    assert validate_parameters("not_a_workload_notebook", {"x": 1}) is None
