"""Gradient checkpointing: keep fewer forward values, recompute the rest during the backward pass.

Under a checkpoint policy the forward pass records each operation's primitive, parents and
constant arguments but none of its values, except the snapshots the policy keeps. When the
backward pass reaches a node whose VJPs need a value that is not kept, the value is recomputed
from the nearest kept ancestors by re-running the recorded primitives (the same operations on the
same inputs, so the values and the gradients are bit for bit those of the plain engine on the
CPU). The backward pass visits nodes in exactly the plain engine's order; only where values come
from differs. Kept values are dropped once their node's VJPs have run.

Policies:
- "sqrt": during the forward pass, keep the output of every s-th operation, doubling s whenever
  more than 2·s are kept, so about √n evenly spaced snapshots remain of n operations; the
  backward pass recomputes one segment at a time and keeps it until its nodes have run.
- an integer N: binomial checkpointing (Griewank and Walther's Revolve). The forward pass keeps
  nothing; each recomputation advances from the nearest kept value and keeps new snapshots at the
  split points that minimise the total recomputation with the free slots, never holding more
  than N. On a chain of l steps this recomputes exactly `revolve_cost(l, N)` operations.

Both work on any program the engine accepts (fan-out, diamonds, several arguments): a value is
recomputed from whatever ancestors are kept; the schedules are optimal for chains.
"""

from __future__ import annotations

import functools
import weakref
from math import comb

def check_policy(checkpoint) -> None:
    """Refuse anything but None, "sqrt" or a positive int, saying what is valid."""
    if checkpoint is None or checkpoint == "sqrt":
        return
    if isinstance(checkpoint, int) and not isinstance(checkpoint, bool) and checkpoint >= 1:
        return
    raise ValueError(f"checkpoint must be None, \"sqrt\" or an int >= 1 (a snapshot budget); got {checkpoint!r}")


@functools.lru_cache(maxsize=None)
def _revolve_table(steps: int, snapshots: int) -> tuple[int, int]:
    """(fewest forward steps to reverse `steps` steps with `snapshots` free slots, best first advance)."""
    if steps <= 1:
        return 0, 0
    if snapshots == 0:
        return steps * (steps - 1) // 2, 0
    best = None
    for advance in range(1, steps):
        cost = advance + _revolve_table(steps - advance, snapshots - 1)[0] + _revolve_table(advance, snapshots)[0]
        if best is None or cost < best[0]:
            best = (cost, advance)
    return best


def revolve_cost(steps: int, snapshots: int) -> int:
    """The fewest forward steps that reverse a chain of `steps` steps, given its initial state and
    `snapshots` slots for more states (reversing step i needs state i - 1)."""
    return _revolve_table(steps, snapshots)[0]


def revolve_cost_closed_form(steps: int, snapshots: int) -> int:
    """Griewank's closed form of `revolve_cost`: r·l − β(c+1, r−1), with β(c, r) = C(c+r, c), r the
    repetition number, β(c, r−1) < l ≤ β(c, r), and c the checkpoints *including* the initial state
    (so c = snapshots + 1 here). A check on the table; both are exact."""
    if steps <= 1:
        return 0
    c = snapshots + 1
    r = 0
    while comb(c + r, c) < steps:
        r += 1
    return r * steps - comb(c + r, c + 1)


def revolve_advance(steps: int, snapshots: int) -> int:
    """How far the optimal schedule advances before keeping its first new snapshot."""
    return _revolve_table(steps, snapshots)[1]


class SqrtSegments:
    """The forward pass's choice for "sqrt": cut the tape into about √n segments, each boundary placed
    where the fewest bytes cross it, and keep at each boundary the values that cross it.

    Boundary b lies between the operations with tape indices b - 1 and b. A value crosses it when
    an operation before b made it and one from b on reads it. While recording, the future readers
    are unknown, but every value that can still be read has a live `Tracer`: the recorded values
    whose tracers are alive are a superset of those crossing, and their bytes are known at once.
    Every `stride` operations the cheapest boundary of that window is committed with those values;
    once the tape is complete, `settle` keeps of each snapshot only the values that truly cross
    (read by an operation the backward pass will run, at or after the boundary).

    Memory is snapshots plus one recomputed segment, so the stride balances the two: when the
    snapshots' distinct bytes exceed twice what a segment of `stride` operations saves for its
    VJPs (at the average the plain engine saves per operation so far), the stride doubles and of
    each pair of boundaries the heavier goes. On a chain whose operations each save one block of
    the size crossing a boundary, that keeps at most 2·stride boundaries: √(n/2) to √(2n).
    """

    def __init__(self, xp, ledger):
        self.xp, self.ledger = xp, ledger
        self.stride = 1
        self.window_end = 1
        self.alive: dict = {}  # Node -> (weak reference to its Tracer, nbytes), while the tracer exists
        self.alive_bytes = 0
        self.snapshots: dict[int, tuple[int, dict]] = {}  # boundary -> (bytes alive there, {Node: value})
        self.candidate: tuple[int, int, dict] | None = None  # the current window's cheapest boundary so far
        self.saved_per_operation = 0.0  # mean bytes the plain engine saves per recorded operation

    def offer(self, index: int, saved_bytes: int) -> None:
        """Operation `index`, which the plain engine would save `saved_bytes` for, is about to be
        recorded: boundary `index` is a candidate."""
        self.saved_per_operation += (saved_bytes - self.saved_per_operation) / (index + 1)
        if index >= self.window_end:
            self._commit()
            self.window_end = index + self.stride
        if index > 0 and (self.candidate is None or self.alive_bytes < self.candidate[0]):
            values = {node: ref().value for node, (ref, _) in self.alive.items()}
            for value in values.values():
                self.ledger.acquire(value)
            if self.candidate is not None:
                self._release(self.candidate[2])
            self.candidate = (self.alive_bytes, index, values)

    def watch(self, tracer) -> None:
        """Count `tracer`'s value as alive (readable by later operations) until the tracer is gone."""
        node = tracer.node
        nbytes = self.xp.storage(tracer.value)[1]
        alive = self.alive

        def gone(_, node=node):
            entry = alive.pop(node, None)
            if entry is not None:
                self.alive_bytes -= entry[1]

        alive[node] = (weakref.ref(tracer, gone), nbytes)
        self.alive_bytes += nbytes

    def _commit(self) -> None:
        if self.candidate is not None:
            nbytes, boundary, values = self.candidate
            self.snapshots[boundary] = (nbytes, values)
            self.candidate = None
        while len(self.snapshots) > 1 and self._snapshot_bytes() > 2 * self.stride * self.saved_per_operation:
            self.stride *= 2
            boundaries = sorted(self.snapshots)
            for first, second in zip(boundaries[::2], boundaries[1::2]):
                heavier = first if self.snapshots[first][0] > self.snapshots[second][0] else second
                self._release(self.snapshots.pop(heavier)[1])

    def _snapshot_bytes(self) -> int:
        """Bytes of the distinct values the committed snapshots hold."""
        held = {node: value for _, values in self.snapshots.values() for node, value in values.items()}
        return sum(self.xp.storage(value)[1] for value in held.values())

    def _release(self, values: dict) -> None:
        for value in values.values():
            self.ledger.release(value)

    def settle(self, last_reader: dict) -> tuple[list[int], dict]:
        """The tape is complete: (sorted boundaries, {Node: value} of every value crossing one), given
        each value's last reader among the operations the backward pass will run (`last_reader`:
        Node -> tape index). Each kept value holds one ledger reference; the rest are let go."""
        self._commit()
        boundaries = sorted(self.snapshots)
        kept = {}
        for boundary, (_, values) in self.snapshots.items():
            for node, value in values.items():
                if node not in kept and last_reader.get(node, -1) >= boundary:
                    kept[node] = value
                    self.ledger.acquire(value)
        self.discard()
        return boundaries, kept

    def discard(self) -> None:
        """Let go of every snapshot the forward pass kept (settled, or the backward pass never ran)."""
        self.alive.clear()  # recording is over: later deaths do not matter
        if self.candidate is not None:
            self._release(self.candidate[2])
            self.candidate = None
        for _, values in self.snapshots.values():
            self._release(values)
        self.snapshots = {}
