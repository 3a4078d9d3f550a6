"""benchlib: measure memory, allocations and GC pauses of gradient engines (see docs/architecture.md).

`Benchmark` and `Parameter` declare a benchmark; `benchlib.registry` finds the declared ones.
"""

from benchlib.benchmark import Benchmark, Config, Parameter, ParameterError, Seed

__all__ = ["Benchmark", "Config", "Parameter", "ParameterError", "Seed"]
