"""How hard `fit` searches: the constants that trade its time for its certainty, in one frozen object (`Search`),
with the default (`THOROUGH`) and a first look (`QUICK`: `benchlib fit --quick`) that starts about half the processes.

Every answer is still measured in fresh processes and confirmed where this machine holds the limit; the quick search
measures fewer points, holds an answer in one process instead of three and ends the search within 10% instead of 2%,
so its answer can sit a little further under the limit and a process-to-process spread goes unseen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Search:
    """The search's constants; see the module's docstring. Fields are checked when made."""

    fractions: tuple[float, ...] = (1 / 8, 1 / 4, 1 / 2, 1)  # of the parameter's given value: the points measured
    steps: int = 3  # measured steps per process, after one warm-up: their median is the engine's time
    # the search by measurement ends when the first value over the limit is this close above the last under it:
    # totals measured in fresh processes a value apart differ by more than the step between them (up to 2.4% on
    # the CPU: a ConvMixer read 1.073 GB at batch 1112 and 1.048 GB at 1113)
    resolution: float = 0.02
    hold_repeats: int = 3  # processes an answer is measured in before it is given (`measured.hold`)
    hold_steps: int = 5  # values `hold` and `step_down` step down through, `resolution` apart, before they give up
    # no answer on a device that can hold the limit lies more than this many times past a measured value: points are
    # measured toward it (`toward_answer`), each where the answer lies `reach * approach_slack` times past it
    reach: int = 2
    approach_slack: float = 0.8
    reach_unbracketed: float = 1.2  # the confirming search's farthest step up from the largest value under the limit
    timid: float = 0.1  # an engine's answer measured this far under the limit is searched up from (`step_down`)
    flat_reach: int = 8  # a total that does not measurably grow is measured again this many times farther out...
    flat_steps: int = 4  # ...this many times at most, before the answer stays the largest value measured
    give_up: int = 2  # an engine refused or failed at this many grid values before any was measured is not asked again
    cap_slack: float = 0.05  # a confirming process ends itself this far past the limit: it is over, and need not go on
    # answers measured in fresh processes before they are given (None: wherever this machine can hold the limit;
    # False: the size model's answers, `--no-verify`)
    verify: bool | None = None
    name: str = "thorough"

    def __post_init__(self):
        if not self.fractions or not all(0 < fraction <= 1 for fraction in self.fractions):
            raise ValueError(f"fractions must be shares of the given value in (0, 1], got {self.fractions!r}")
        if not 0 < self.resolution < 1:
            raise ValueError(f"resolution must be a share in (0, 1), got {self.resolution!r}")
        if not (self.reach > 1 and 0 < self.approach_slack <= 1 and self.reach_unbracketed > 1 and self.flat_reach > 1):
            raise ValueError("reach, reach_unbracketed and flat_reach must be above 1, approach_slack in (0, 1]")
        if not (0 < self.timid < 1 and 0 <= self.cap_slack < 1):
            raise ValueError(f"timid must be a share in (0, 1), cap_slack in [0, 1), got {self.timid!r}, "
                             f"{self.cap_slack!r}")
        for field in ("steps", "hold_repeats", "hold_steps", "flat_steps", "give_up"):
            if not (isinstance(getattr(self, field), int) and getattr(self, field) >= 1):
                raise ValueError(f"{field} must be an integer >= 1, got {getattr(self, field)!r}")

    def verifying(self, verify: bool | None) -> Search:
        """This search, confirming its answers as `verify` says (None: where this machine can)."""
        return dataclasses.replace(self, verify=verify)

    @property
    def summary(self) -> str:
        """The search in words, for the answer's header and the run's record."""
        return (f"{self.name} search: {len(self.fractions)} points, {self.steps} measured step(s) per process, "
                f"answers held in {self.hold_repeats} process(es), to {100 * self.resolution:g}%")


THOROUGH = Search()
QUICK = Search(fractions=(1 / 4, 1 / 2, 1), steps=1, resolution=0.1, hold_repeats=1, hold_steps=3, name="quick")
