"""Reference cycles that hold a step's tensors, left the way training code leaves them.

The pattern is the kept exception: a step check catches the failure it raises and keeps it in a
local (`error = exc`) to log it later. The exception's traceback refers to the check's frame, and
the frame's locals refer to the exception: frame -> error -> traceback -> frame, a cycle that also
holds everything else in the frame, here a standardised copy of the step's batch. Reference
counting never frees such a cycle; only Python's cyclic collector does, on its own schedule. A
frame that outlives its call also keeps its caller's frame (`f_back`), so the step's own batch,
a local of the step function, is held too, as in real code. The loop keeps the last step's
failures for its log, so each step's cycles become garbage one step later, after young collections
may already have promoted them.
"""

from __future__ import annotations

import weakref

from benchlib.errors import Refused


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
    how many bytes of tensors the uncollected ones still hold: the step's batch and each cycle's
    copy of it have a weak reference whose callback runs when the collector frees them
    (`held_bytes`, `held_tensors`). The callbacks run inside the collection that frees them, one
    dict removal per tensor."""

    def __init__(self, per_step: int):
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 0:
            raise Refused(f"cycles per step must be an integer >= 0, got {per_step!r}")
        self.per_step = per_step
        self._held: dict[weakref.ref, int] = {}
        self._kept: list = []

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    @property
    def held_tensors(self) -> int:
        return len(self._held)

    def _watch(self, tensor) -> None:
        self._held[weakref.ref(tensor, self._held.pop)] = tensor.element_size() * tensor.nelement()

    def leave(self, batch, losses) -> None:
        """This step's checks, each leaving one cycle that holds its own standardised copy of
        `batch` (and, through the frames, `batch` itself: a new tensor every step); the previous
        step's kept failures are dropped, so their cycles become garbage."""
        if not self.per_step:
            return
        self._watch(batch)
        kept = []
        for _ in range(self.per_step):
            standardised = (batch - batch.mean()) / (batch.std() + 1e-6)
            self._watch(standardised)
            kept.append(check_step(standardised, losses))
        del standardised
        self._kept = kept

    def close(self) -> None:
        """Drop the last step's failures (their cycles wait for the next collection)."""
        self._kept = []
