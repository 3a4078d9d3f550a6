"""The registry of step techniques: benchlib's own (`builtin`, `parallel`), a model file's own (`TECHNIQUES`) and an
installed package's (entry-point group `benchlib.techniques`), each checked when it joins, and the combinations
a model file's run adds (`-p combinations=default|all|none`)."""


from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping

from benchlib.engine_names import COMBINED, DEFAULT_COMBINATIONS, TORCH, TORCH_COMPILE, TORCH_COMPILE_BUDGETS
from benchlib.engines.techniques.base import Aspect, CombinationError, Need, Technique, TechniqueFault, refusal
from benchlib.engines.techniques.builtin import BUILTIN
from benchlib.engines.techniques.parallel import PARALLEL

ENTRY_POINT_GROUP = "benchlib.techniques"
SWEEP = tuple(TORCH_COMPILE_BUDGETS)  # left out of a first look (--quick) and of fit unless named
COMPILING = (TORCH_COMPILE, *TORCH_COMPILE_BUDGETS)  # set-ups that compile: seconds a trial, left out of --quick too
ALL, DEFAULT, NONE = "all", "default", "none"  # which combinations a model file's run adds (-p combinations=)
COMBINATION_CHOICES = (DEFAULT, ALL, NONE)


def check_technique(name: str, technique: object, source: str) -> type[Technique]:
    """`technique` as a registered technique class named `name`, or CombinationError saying what is wrong."""
    if not isinstance(technique, type) or not issubclass(technique, Technique):
        raise CombinationError(f"{source}: {name!r} must be a subclass of benchlib.engines.techniques.Technique, "
                               f"got {technique!r}")
    if not name or COMBINED in name or name != name.strip():
        raise CombinationError(f"{source}: technique name {name!r} must be non-empty, without spaces around it, and "
                               f"without {COMBINED!r} (which joins techniques)")
    if name in BUILTIN or name in PARALLEL:
        raise CombinationError(f"{source}: {name!r} is benchlib's own technique; give yours another name")
    if technique.name and technique.name != name:
        raise CombinationError(f"{source}: {name!r} maps to {technique.__name__}, whose name is {technique.name!r}")
    for attribute, members in (("changes", Aspect), ("needs", Need)):
        value = getattr(technique, attribute)
        if not isinstance(value, (set, frozenset)) or not all(isinstance(member, members) for member in value):
            raise CombinationError(f"{source}: technique {name!r}: {attribute} must be a frozenset of "
                                   f"{members.__name__} members ({', '.join(member.name for member in members)}), "
                                   f"got {value!r}")
    if not technique.name:  # a class named only by the mapping that registers it
        technique = type(technique.__name__, (technique,), {"name": name})
    return technique


@functools.cache
def installed_techniques() -> tuple[tuple[str, type[Technique]], ...]:
    """Techniques installed packages register under the entry-point group `benchlib.techniques`."""
    from importlib.metadata import entry_points

    return tuple((point.name, check_technique(point.name, point.load(), f"entry point {point.value}"))
                 for point in entry_points(group=ENTRY_POINT_GROUP))


def technique_registry(own: Mapping[str, object] | None = None, source: str = "TECHNIQUES") -> dict[str, type[Technique]]:
    """Every technique a run can name, in the order combinations list them: benchlib's own (eager torch, the
    parallel strategies, the rest), then installed packages', then `own` (a model file's `TECHNIQUES`: its classes where the file was read here, or the aspects
    each changes where a child read it, as `stand_in`s)."""
    registry: dict[str, type[Technique]] = {TORCH: BUILTIN[TORCH], **PARALLEL, **BUILTIN}
    own = {name: stand_in(name, technique) if isinstance(technique, (list, tuple)) else technique
           for name, technique in (own or {}).items()}
    for name, technique in (*installed_techniques(), *own.items()):
        checked = check_technique(name, technique, source)
        if name in registry:
            raise CombinationError(f"{source}: technique {name!r} is registered twice (an installed package has it)")
        registry[name] = checked
    return registry


def stand_in(name: str, aspects: Iterable[str]) -> type[Technique]:
    """A technique known by its name and the aspects it changes only (a model file's own, as the child that read
    the file reported it): enough to check a combination's shared aspects where the class itself is not loaded."""
    return type(f"StandIn[{name}]", (Technique,), {"name": name,
                                                    "changes": frozenset(Aspect[aspect] for aspect in aspects)})


def _valid(names: Iterable[str], registry: Mapping[str, type[Technique]]) -> bool:
    """Whether the techniques join; a join whose `refuses` raises is not added (the engines that name that
    technique fail, saying which hook raised)."""
    parts = [registry[name]() for name in names]
    try:
        return all(refusal(first, second) is None for first, second in itertools.combinations(parts, 2))
    except TechniqueFault:
        return False


def added_combinations(which: str, registry: Mapping[str, type[Technique]], named: Iterable[str] = ()) -> list[str]:
    """The combinations `-p combinations=which` adds to the named engines: the ones users reach for
    (`DEFAULT_COMBINATIONS`), every valid join of two or more techniques (eager torch, the parallel strategies
    and the compile budget sweep left out), or none."""
    if which not in COMBINATION_CHOICES:
        raise CombinationError(f"combinations must be one of {', '.join(COMBINATION_CHOICES)}, got {which!r}")
    named = set(named)
    if which == NONE:
        return []
    if which == DEFAULT:
        return [name for name in DEFAULT_COMBINATIONS if name not in named]
    joinable = [name for name in registry if name not in (TORCH, *SWEEP, *PARALLEL)]
    found = [COMBINED.join(group) for size in range(2, len(joinable) + 1)
             for group in itertools.combinations(joinable, size) if _valid(group, registry)]
    return [name for name in found if name not in named]


def placement_of(engine: str) -> tuple[int, str]:
    """An engine's parallel strategy (its place in `PARALLEL`, from 1; 0 for one process) and the rest of its name,
    eager torch where it names a strategy alone (`ddp+torch-checkpoint` -> (1, "torch-checkpoint"))."""
    parts = engine.split(COMBINED)
    strategy = next((index for index, name in enumerate(PARALLEL, 1) if name in parts), 0)
    return strategy, COMBINED.join(part for part in parts if part not in PARALLEL) or TORCH
