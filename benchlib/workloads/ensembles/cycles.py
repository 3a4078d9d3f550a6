"""Reference cycles that hold a step's tensors, left the way training code leaves them.

The pattern is the kept exception: a step check catches the failure it raises and keeps it in a
local (`error = exc`) to log it later. The exception's traceback refers to the check's frame, and
the frame's locals refer to the exception: frame -> error -> traceback -> frame, a cycle that also
holds everything else in the frame, here a standardised copy of the step's batch. Reference
counting never frees such a cycle; only Python's cyclic collector does, on its own schedule. The
loop keeps the last step's failures for its log, so each step's cycles become garbage one step
later, after young collections may already have promoted them.
"""

from __future__ import annotations

import weakref


class StepCheckFailed(Exception):
    """What the step check raises, and the loop keeps."""


def check_step(standardised_batch, losses):
    """The step check: what it checks does not matter here, only how it keeps its failure. The
    returned exception's traceback holds this frame, and so both tensors, until the cyclic
    collector finds the cycle."""
    try:
        raise StepCheckFailed(f"step check failed for {losses.shape[0]} nets")
    except StepCheckFailed as exc:
        error = exc  # outlives the except block: frame -> error -> traceback -> frame
    return error


class StepCycles:
    """Leaves `per_step` cycles in every step (`leave`, inside the timed step), and knows exactly
    how many bytes of tensors the uncollected ones still hold: each held tensor has a weak
    reference whose callback runs when the collector frees it (`held_bytes`, `held_cycles`)."""

    def __init__(self, per_step: int):
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 0:
            raise ValueError(f"cycles per step must be an integer >= 0, got {per_step!r}")
        self.per_step = per_step
        self.held_bytes = 0
        self._held: dict[weakref.ref, int] = {}
        self._kept: list = []

    @property
    def held_cycles(self) -> int:
        return len(self._held)

    def _freed(self, ref: weakref.ref) -> None:
        self.held_bytes -= self._held.pop(ref)

    def leave(self, batch, losses) -> None:
        """This step's checks, each leaving one cycle that holds its own standardised copy of
        `batch`; the previous step's kept failures are dropped, so their cycles become garbage."""
        if not self.per_step:
            return
        kept = []
        for _ in range(self.per_step):
            standardised = (batch - batch.mean()) / (batch.std() + 1e-6)
            size = standardised.element_size() * standardised.nelement()
            self._held[weakref.ref(standardised, self._freed)] = size
            self.held_bytes += size
            kept.append(check_step(standardised, losses))
        del standardised
        self._kept = kept

    def close(self) -> None:
        """Drop the last step's failures (their cycles wait for the next collection)."""
        self._kept = []
