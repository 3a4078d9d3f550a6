"""A fit's progress: each fresh process numbered against those planned, with the time spent and the time left
for the rest. The only clock in `benchlib.fit`, read to tell the user, never for a figure."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable


class Pace:
    """Numbers and times the processes of a fit as they finish (`done`), passes other lines through (`say`). A
    process is taken to cost time in proportion to its value plus the smallest value planned (what any process
    costs: starting, building the model), so the time left weighs the large values still to come."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.left: Counter[int] = Counter()  # values planned and not yet done
        self.count = 0
        self.weight_done = 0.0
        self.fixed: int | None = None
        self.started = time.monotonic()

    def expect(self, values: Iterable[int]) -> None:
        """More processes to come, by value (the grid at first; points toward the answer, confirmations)."""
        self.left.update(values)
        if self.left:
            self.fixed = min(self.left) if self.fixed is None else min(self.fixed, min(self.left))

    def drop(self, value: int) -> None:
        """A planned process that will not run."""
        if self.left[value]:
            self.left[value] -= 1

    def done(self, line: str, value: int) -> None:
        self.drop(value)
        self.count += 1
        self.weight_done += value + (self.fixed or 0)
        spent = time.monotonic() - self.started
        rest = sum(count * (each + (self.fixed or 0)) for each, count in self.left.items())
        planned = self.count + sum(self.left.values())
        left = f", ~{_clock(spent / self.weight_done * rest)} left" if rest else ""
        self.say(f"[{self.count}/{planned}, {_clock(spent)}{left}] {line}")


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}:{seconds:02d}"
