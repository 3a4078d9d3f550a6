"""One module per benchmark: the workload for each engine, its cases and its checks.

`validate_parameters(notebook, params)` is what the runner calls while planning: each notebook's
values checked by its workload's own rules before any kernel starts.
"""

from benchlib.workloads.parameters import ParameterError, validate_parameters

__all__ = ["ParameterError", "validate_parameters"]
