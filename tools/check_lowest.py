"""Check that an environment made by uv's lowest-direct resolution (`make lowest`) holds every dependency
pyproject.toml declares at exactly its declared lower bound: the tests that run there then test each bound.
A bound that another package's own needs pushed higher is named, with the version that was installed, so the
declaration is raised to what was tested rather than left claiming what was not."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version


def untested_bounds(pyproject: Path) -> list[str]:
    """One line per declared dependency whose installed version is not its lower bound (or that has none)."""
    problems = []
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate():
            continue
        lower = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
        if len(lower) != 1:
            problems.append(f"{requirement}: needs exactly one '>=' lower bound to be tested")
            continue
        try:
            installed = Version(importlib.metadata.version(requirement.name))
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name}: declared, not installed")
            continue
        if Version(installed.base_version) != lower[0]:
            problems.append(f"{requirement.name}: declared >={lower[0]}, but the lowest resolution installed "
                            f"{installed}: raise the bound to what was tested")
    return problems


if __name__ == "__main__":
    found = untested_bounds(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))
    print("\n".join(found) if found else "every declared dependency is at its lower bound")
    sys.exit(1 if found else 0)
