"""A fit's progress: each fresh process numbered against those planned, with the time spent and the time left
for the rest. The only clock in `benchlib.fit`, read to tell the user, never for a figure."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable


class Pace:
    """Numbers and times the processes of a fit as they finish (`done`), passes other lines through (`say`). A
    process is taken to cost time in proportion to its value plus the smallest value planned (what any process
    costs: starting, building the model), so the time left weighs the large values still to come. Processes a search
    asks for one at a time (`expect(..., searching=True)`) have no total to count against: their lines say how many
    have run. A phase's header (`announce`) is printed with its first line, so a phase with nothing to do says
    nothing."""

    def __init__(self, say: Callable[[str], None]):
        self._print = say
        self.left: Counter[int] = Counter()  # values planned and not yet done
        self.count = 0
        self.weight_done = 0.0
        self.fixed: int | None = None
        self.searching = False
        self._header: str | None = None
        self.started = time.monotonic()

    def say(self, line: str) -> None:
        if self._header is not None:
            header, self._header = self._header, None
            self._print(header)
        self._print(line)

    def announce(self, header: str) -> None:
        """The header of the phase that begins: said before its first line, if it has one."""
        self._header = header

    def expect(self, values: Iterable[int], searching: bool = False) -> None:
        """More processes to come, by value: planned (the grid), or one a search asks for (`searching`)."""
        self.left.update(values)
        self.searching = searching
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
        if self.searching and not rest:  # how many more a search asks for is not known: no total, no time left
            self.say(f"[{self.count}, {_clock(spent)}] {line}")
            return
        planned = self.count + sum(self.left.values())
        left = f", ~{_clock(spent / self.weight_done * rest)} left" if rest else ""
        self.say(f"[{self.count}/{planned}, {_clock(spent)}{left}] {line}")


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}:{seconds:02d}"
