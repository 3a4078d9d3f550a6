"""What the command line's values stand for: `-p NAME=VALUE` assignments, `--grid NAME=V1,V2` axes, and the
parameters `--ranks`, `--parallel` and `--global-batch NAME=B` set. Text only: each value is parsed and checked by the parameter
that declares it (`runner.preflight`)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from benchlib.errors import Refused


class RunnerError(Refused):
    """Input the runner refuses before anything runs; the message says what is valid. Here, with the command line's
    text, so that parsing it loads nothing else of the runner."""


def parse_assignment(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` from the command line."""
    name, equals, value = text.partition("=")
    if not equals or not name.strip().isidentifier():
        raise RunnerError(f"-p takes NAME=VALUE (e.g. -p repeats=3 or -p engines='[\"torch\"]'), got {text!r}")
    return name.strip(), value


def parse_assignments(texts: Sequence[str]) -> dict[str, str]:
    """`-p NAME=VALUE` assignments as a dict; a name given twice is refused (which one would win is a guess)."""
    params: dict[str, str] = {}
    for text in texts:
        name, value = parse_assignment(text)
        if name in params:
            raise RunnerError(f"-p {name} is given twice ({params[name]!r} and {value!r}); give each parameter once")
        params[name] = value
    return params


def ranks_params(arguments, params: dict[str, str]) -> dict[str, str]:
    """`params` (the -p assignments) with what --ranks, --parallel and --global-batch NAME=B stand for: the ranks,
    their strategies, and NAME at B split evenly over the ranks (each rank's batch); RunnerError where B does not
    split, there are no ranks to split it over, or -p gives NAME, the ranks or the strategies too."""
    given = dict(params)
    for flag, name in (("--ranks", "ranks"), ("--parallel", "parallel")):
        if getattr(arguments, name) is not None and name in params:
            raise RunnerError(f"{flag} {getattr(arguments, name)} and -p {name}={params[name]} both set {name}; give one")
    if arguments.ranks is not None:
        given["ranks"] = str(arguments.ranks)
    if arguments.parallel is not None:
        given["parallel"] = arguments.parallel
    _refuse_ranks_without_a_spread(given, "engines" in given or getattr(arguments, "engines", None) is not None)
    if getattr(arguments, "global_batch", None) is None:
        return given
    name, value = parse_assignment(arguments.global_batch)
    ranks = arguments.ranks or 1
    if ranks < 2:
        raise RunnerError(f"--global-batch {name}={value} is split over the ranks: give --ranks N (N >= 2) and --parallel")
    if name in params:
        raise RunnerError(f"-p {name} and --global-batch {name}= both set {name}; give one (-p sets each rank's)")
    try:
        total = int(value)
    except ValueError:
        raise RunnerError(f"--global-batch {name}={value!r}: the global batch must be a whole number") from None
    if total < 1:
        raise RunnerError(f"--global-batch {name}={total}: the global batch must be at least 1 sample per rank "
                          f"({name}={ranks} or more over {ranks} ranks)")
    if total < ranks or total % ranks:
        raise RunnerError(f"--global-batch {name}={total} does not split evenly over {ranks} ranks; a multiple of "
                          f"{ranks} does (e.g. {name}={max(ranks, total - total % ranks)})")
    given[name], given["global_batch"] = str(total // ranks), name
    return given


def _refuse_ranks_without_a_spread(given: dict[str, str], engines_named: bool) -> None:
    """What the flags alone settle, refused before any file is read (seconds): a strategy that does not exist, one on
    a single process, or several ranks with neither a strategy nor engines named (the default, eager torch alone,
    places nothing; named engines may place the step, which their file's reading tells)."""
    from benchlib.engine_names import no_ranks, no_spread, parallel_strategies_named

    strategies = parallel_strategies_named(given.get("parallel", ""))
    try:
        ranks = int(given.get("ranks", 1))
    except ValueError:  # the parameter's own check says what is valid
        return
    if strategies and ranks == 1:
        raise RunnerError(no_ranks(strategies))
    if ranks > 1 and not strategies and not engines_named:
        raise RunnerError(no_spread(ranks))


def parse_grid(assignments: Sequence[str]) -> dict[str, list[Any]]:
    """`NAME=V1,V2,...` texts as {name: [values]}: the values as one Python list literal where they
    parse as one (`D=100,200`, `engines=['a'],['b']`), else comma-separated text (`dtype=float32,float64`)."""
    grid: dict[str, list[Any]] = {}
    for text in assignments:
        name, equals, values = text.partition("=")
        name = name.strip()
        if not equals or not name.isidentifier() or not values:
            raise RunnerError(f"--grid takes NAME=V1,V2,... (e.g. --grid D=100,200 or --grid dtype=float32,float64), got {text!r}")
        if name in grid:
            raise RunnerError(f"--grid {name} is given twice; list all its values in one --grid")
        try:
            parsed = ast.literal_eval(f"[{values}]")
        except (ValueError, SyntaxError):
            parsed = None
        grid[name] = parsed if isinstance(parsed, list) and parsed else values.split(",")
        if len(set(map(repr, grid[name]))) != len(grid[name]):
            raise RunnerError(f"--grid {name} repeats a value: {values}")
    return grid
