"""A package's public names imported from their home modules when first asked for (PEP 562), so that a
process importing one light part of the package (a refusal, a planning step) loads none of the rest."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """The module `__getattr__` of `package`: `homes` maps each public name to its submodule's name."""

    def __getattr__(name: str) -> object:
        if name in homes:
            return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
