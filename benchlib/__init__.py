"""benchlib: measure memory, allocations and GC pauses of gradient engines (see docs/architecture.md).

`Benchmark` and `Parameter` declare a benchmark; `benchlib.registry` finds the declared ones;
`benchlib.profile(path_or_functions)` measures a model file from Python (benchlib.runner.profile_run).
"""

from benchlib.benchmark import Benchmark, Config, Parameter, ParameterError, Seed

__all__ = ["Benchmark", "Config", "Parameter", "ParameterError", "Seed", "profile"]


def __getattr__(name: str):
    if name == "profile":  # imported when used: it needs the runner, which `import benchlib` must not pull in
        from benchlib.runner.profile_run import profile

        return profile
    raise AttributeError(f"module 'benchlib' has no attribute {name!r}")
