"""Where benchmarks are found: the built-ins, and those other packages declare through entry points.

A package declares a benchmark by naming a `Benchmark` (or a function returning one) in the
entry-point group `benchlib.benchmarks`:

    [project.entry-points."benchlib.benchmarks"]
    my_bench = "my_package.bench:BENCHMARK"

Discovery refuses, naming the module, an entry that does not load, is not a `Benchmark`, or
reuses a name already taken: a benchmark name means one thing in every run.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from importlib.metadata import entry_points

from benchlib.benchmark import Benchmark, DeclarationError

ENTRY_POINT_GROUP = "benchlib.benchmarks"


class RegistryError(DeclarationError):
    """A declaration discovery refuses; the message names the module that declared it."""


def _load(target: str, where: str) -> Benchmark:
    module_name, _, attribute = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute) if attribute else importlib.import_module(module_name)
        if callable(found) and not isinstance(found, Benchmark):
            found = found()
    except DeclarationError as error:
        raise RegistryError(f"{where} ({target}): {error}") from None
    except Exception as error:  # an entry point that does not even import must say which one
        raise RegistryError(f"{where} ({target}) failed to load: {type(error).__name__}: {error}") from None
    if not isinstance(found, Benchmark):
        raise RegistryError(f"{where} ({target}) is a {type(found).__name__}, not a benchlib.Benchmark")
    return found


def _builtin_targets() -> list[str]:
    """"module:BENCHMARK" of every module or package of `benchlib.workloads` that declares one: a new
    built-in is found by being there, with no list to edit."""
    import benchlib.workloads as workloads

    targets = []
    for module in pkgutil.iter_modules(workloads.__path__, f"{workloads.__name__}."):
        if isinstance(getattr(importlib.import_module(module.name), "BENCHMARK", None), Benchmark):
            targets.append(f"{module.name}:BENCHMARK")
    return targets


@lru_cache(maxsize=1)
def benchmarks() -> dict[str, Benchmark]:
    """Every declared benchmark by name: the built-ins (yardsticks first, then by name), then the
    entry points in name order; each registered (`Benchmark.register`), once every name is known unique."""
    found: dict[str, tuple[Benchmark, str]] = {}
    builtin = sorted(((_load(target, "built-in"), "built-in", target) for target in _builtin_targets()),
                     key=lambda source: (not source[0].yardstick, source[0].name))
    sources = list(builtin)
    for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        where = f"entry point {entry.name!r} of group {ENTRY_POINT_GROUP}"
        sources.append((_load(entry.value, where), where, entry.value))
    for benchmark, where, target in sources:
        if benchmark.name in found:
            raise RegistryError(f"{where} ({target}) declares benchmark {benchmark.name!r}, which "
                                f"{found[benchmark.name][1]} already declares; names must be unique")
        found[benchmark.name] = (benchmark, f"{where} ({target})")
    for benchmark, where in found.values():
        try:
            benchmark.register()
        except DeclarationError as error:
            raise RegistryError(f"{where}: {error}") from None
    return {name: benchmark for name, (benchmark, _) in found.items()}


def get(name: str) -> Benchmark:
    """The benchmark called `name`; KeyError listing the valid names otherwise."""
    known = benchmarks()
    if name not in known:
        raise KeyError(f"unknown benchmark {name!r}; declared: {', '.join(known)}")
    return known[name]


def resolve(name_or_path: str | Sequence[str], checked: Mapping[str, str] | None = None) -> Benchmark:
    """A declared benchmark by name, else the benchmark the model file at that path declares (a list of
    paths: versions of one NAME, one benchmark; `checked`: the digests of file contents a form check already
    passed, `usermodel.declare_model_files`). A file whose NAME a declared benchmark already has is
    refused (`RegistryError`), as a duplicate entry point is; a file the torch form refuses raises
    `benchlib.usermodel.ModelFileError`. Either way the benchmark comes registered (`Benchmark.register`)."""
    if isinstance(name_or_path, str) and (name_or_path in benchmarks() or not (
            name_or_path.endswith(".py") or Path(name_or_path).is_file())):
        return get(name_or_path)
    from benchlib.usermodel import load_model_files

    benchmark = load_model_files([name_or_path] if isinstance(name_or_path, str) else name_or_path, checked)
    refuse_declared_name(benchmark, name_or_path)
    return benchmark.register()


def refuse_declared_name(benchmark: Benchmark, source: str | Sequence[str]) -> None:
    """A model file may not take a declared benchmark's NAME (`RegistryError`), as a duplicate entry point may not."""
    if benchmark.name in benchmarks():
        raise RegistryError(f"{source}: NAME {benchmark.name!r} is a declared benchmark's; give the file "
                            "another NAME")


def verdict_rules() -> tuple:
    """The seed rules of every declared benchmark."""
    return tuple(rule for benchmark in benchmarks().values() for rule in benchmark.verdicts)


def yardsticks(declared: Mapping[str, Benchmark] | None = None) -> tuple[str, ...]:
    """The benchmarks declared `yardstick` (of `declared`, default every one): they measure the machine,
    so they run first and their timings are what `compare` reads as the machine's drift."""
    return tuple(name for name, benchmark in (benchmarks() if declared is None else declared).items()
                 if benchmark.yardstick)
