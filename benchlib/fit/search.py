"""fit's one search loop and the largest value it looks for.

Every search fit makes, over a size model, over traces or over measured processes, is `drive`: proposals give the next value
(they end when they have their answer, or nothing more is worth a probe), a probe learns that value's total (or
says it could not, and the search stops). The phases differ only in what they propose (`benchlib.fit.measured`:
farther out, toward the answer, holding an answer, stepping down); the largest value under a limit is proposed
by `Toward`, whose `Bracketing` says what a probe costs: a size model is free, a trace takes seconds, a measured
process a minute and comes back noisy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

SEARCH_LIMIT = 2 ** 40  # the largest value a search looks at: a total that does not grow fits "at any value"

Probe = Callable[[int], bool]  # learn the value's total; False: it could not (its line said why), the search stops


def drive(proposals: Iterable[int], probe: Probe) -> None:
    """The loop every fit search runs: each value proposed is probed, until the proposals end (they have their
    answer, or nothing more is worth a probe) or a probe fails. Proposals are read one at a time, each after the
    previous probe, so they see what it learnt."""
    for value in proposals:
        if not probe(value):
            return


@dataclass(frozen=True)
class Bracketing:
    """How `Toward` proposes; the defaults are an exact search over a free total (a size model)."""

    resolution: float = 0.0  # done when the first value over lies this share of the last under above it
    step: int = 1  # values are multiples of it (micro-batches need a multiple of their count)
    reach: float = math.inf  # before anything is over, the next value lies at most this many times the largest under
    ceiling: int = SEARCH_LIMIT  # nothing past it is proposed; where it is under, it is the answer
    # after a guess along the line inside the bracket, its neighbour (one more probe ends the search where the line was
    # right) and a halving only where the two did not halve the bracket; without it, a halving after every guess
    neighbour: bool = False


class Toward:
    """Proposes values toward the largest whose total stays under `limit`, from what is known when it is asked:
    `totals()` (value -> total) and `over()` (values over without a total: a step that failed, past which nothing is
    an answer). Each next value is where the line through the nearest totals crosses the limit, halvings between as
    `Bracketing` says, so a line that is right ends the search in a probe or two and one that is far off costs a few
    per halving. `answer` is set when it stops by itself: the largest value under (None: nothing is under, or no
    bracket was found and `flat` totals draw no line to follow)."""

    def __init__(self, totals: Callable[[], Mapping[int, float]], limit: float, bracketing: Bracketing = Bracketing(),
                 over: Callable[[], Collection[int]] = tuple, flat: bool = False):
        self.totals, self.limit, self.bracketing, self.over, self.flat = totals, limit, bracketing, over, flat
        self.answer: int | None = None
        self._last = ""  # what the previous proposal was: "line" (inside a bracket), "neighbour", "halve", "out"
        self._guess: int | None = None
        self._width: int | None = None  # the bracket's width before the last line guess

    def __iter__(self) -> Iterator[int]:
        while (value := self._next()) is not None:
            yield value

    def _next(self) -> int | None:
        totals, b = self.totals(), self.bracketing
        first_failed = min(self.over(), default=None)
        under = [value for value, total in totals.items()
                 if total <= self.limit and value <= b.ceiling and (first_failed is None or value < first_failed)]
        if not under:
            return None
        low = max(under)
        high = min([value for value, total in totals.items() if total > self.limit and value > low]
                   + [value for value in self.over() if value > low], default=None)
        if high is None and low >= b.ceiling or high is not None and high - low <= max(b.step,
                                                                                      int(low * b.resolution)):
            self.answer = low
            return None
        if high is None:
            return None if self.flat else self._out(totals, under, low)
        if b.neighbour and self._last in ("line", "out") and high - low > b.step:  # did the guess land at the edge?
            self._last = "neighbour"
            return low + b.step if self._guess == low else high - b.step
        if high not in totals or self.flat or self._halving(low, high):
            self._last = "halve"
            return multiple_of((low + high) // 2, b.step)
        self._last, self._width = "line", high - low
        guess = _crossing(low, totals[low], high, totals[high], self.limit)
        self._guess = min(high - b.step, max(low + b.step, multiple_of(guess, b.step)))
        return self._guess

    def _out(self, totals: Mapping[int, float], under: list[int], low: int) -> int:
        """Past everything measured: along the line through the two largest values under, at most `reach` past."""
        b = self.bracketing
        below = sorted(under)[-2:]
        crossing = _crossing(below[0], totals[below[0]], low, totals[low], self.limit)
        if math.isfinite(b.reach):
            crossing = min(crossing, int(low * b.reach))
        self._last, self._width = "out", None
        self._guess = min(b.ceiling, max(low + b.step, multiple_of(crossing, b.step)))
        return self._guess

    def _halving(self, low: int, high: int) -> bool:
        """Whether the next proposal halves the bracket: after every line guess (noisy totals: a line through two of
        them can land anywhere), or, with neighbours, after a line and its neighbour that did not halve it."""
        if not self.bracketing.neighbour:
            return self._last == "line"
        return self._last == "neighbour" and self._width is not None and high - low > self._width / 2


def largest_under(total: Callable[[int], float], limit: float, known: dict[int, float],
                  bracketing: Bracketing = Bracketing()) -> int | None:
    """The largest value whose `total` stays under `limit`, searched from `known` (value -> total, extended with every
    value it asks): None when not even the smallest known fits; the ceiling when the total never reaches the limit."""
    toward = Toward(lambda: known, limit, bracketing)

    def probe(value: int) -> bool:
        known[value] = total(value)
        return True

    drive(toward, probe)
    return toward.answer


def _crossing(value_a: int, total_a: float, value_b: int, total_b: float, limit: float) -> int:
    """The value where the straight line through two (value, total) points reaches `limit`, rounded down; twice the
    larger value where the line does not rise (the totals are one allocator step apart)."""
    if value_a == value_b or total_b <= total_a:
        return 2 * max(value_a, value_b)
    return int(value_b + (limit - total_b) * (value_b - value_a) / (total_b - total_a))


def multiple_of(value: int, step: int) -> int:
    """`value` rounded down to a multiple of `step`, at least `step`."""
    return max(step, value - value % step)
