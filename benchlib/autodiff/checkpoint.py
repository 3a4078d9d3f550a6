"""Gradient checkpointing: keep fewer forward values, recompute the rest during the backward pass.

Under a checkpoint policy the forward pass records each operation's primitive, parents and
constant arguments but none of its values, except the snapshots the policy keeps. When the
backward pass reaches a node whose VJPs need a value that is not kept, the value is recomputed
from the nearest kept ancestors by re-running the recorded primitives (the same operations on the
same inputs, so the values and the gradients are bit for bit those of the plain engine on the
CPU). The backward pass visits nodes in exactly the plain engine's order; only where values come
from differs. Kept values are dropped once their node's VJPs have run.

Policies:
- "sqrt": the tape is cut into segments, about √n of n operations on a chain; each boundary's
  snapshot holds the values crossing it. While recording, `SqrtSegments` keeps the boundaries of
  the best plans for the tape so far (by an estimate); once it is complete, `choose_boundaries`
  picks among them with an exact model of the backward pass (`TapeProfile`). The backward pass
  recomputes one segment at a time, at most once, and keeps it until its nodes have run.
- an integer N: binomial checkpointing (Griewank and Walther's Revolve). The forward pass keeps
  nothing; each recomputation advances from the nearest kept value and keeps new snapshots at the
  split points that minimise the total recomputation with the free slots, never holding more
  than N. On a chain of l steps this recomputes exactly `revolve_cost(l, N)` operations.

Both work on any program the engine accepts (fan-out, diamonds, several arguments): a value is
recomputed from whatever ancestors are kept; the schedules are optimal for chains.
"""

from __future__ import annotations

import bisect
import functools
import weakref
from math import comb
from typing import NamedTuple

import numpy as np

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


class TapeProfile:
    """The complete tape as the backward pass will meet it, to price a choice of boundaries before it starts.

    One entry per recorded value the backward pass reaches, in backward order, as arrays: `made`
    (tape index of its operation), `last_read` (largest tape index of a consumer: it crosses
    boundary b when made < b <= last_read), `nbytes`, `first_read` (the backward step of the first
    VJP that reads it; `steps` if none does) and `released` (the step after which nothing needs it:
    its consumers and, if its VJP reads it, its own operation have run). `gradient_bytes[t]`: the
    gradients held at backward step t, from a value's first contribution until its operation has
    run (a leaf's until the end), the same under any boundaries.
    """

    def __init__(self, order: list, consumers: dict, nbytes: dict, leaf_bytes: dict):
        """`order`: the operations in backward order; `consumers`: Node -> the operations reading it;
        `nbytes`: bytes of each recorded value; `leaf_bytes`: bytes of each differentiated argument."""
        self.steps = steps = len(order)
        step = {node: t for t, node in enumerate(order)}
        made, last_read, sizes, first_read, released = [], [], [], [], []
        gradients = np.zeros(steps + 1, dtype=np.int64)
        for node in order:
            readers = consumers.get(node, ())
            reading = [step[c] for c in readers if c.primitive.save_inputs]
            needing = [step[c] for c in readers]
            if node.primitive.save_output:
                reading.append(step[node])
                needing.append(step[node])
            made.append(node.index)
            last_read.append(max((c.index for c in readers), default=-1))
            sizes.append(nbytes[node])
            first_read.append(min(reading, default=steps))
            released.append(max(needing, default=0))
            gradients[min((step[c] for c in readers), default=0)] += nbytes[node]
            gradients[step[node] + 1] -= nbytes[node]
        for leaf, size in leaf_bytes.items():
            if leaf in consumers:
                gradients[min(step[c] for c in consumers[leaf])] += size
        self.nodes = list(order)
        self.made, self.last_read, self.nbytes = np.array(made), np.array(last_read), np.array(sizes, dtype=np.int64)
        self.first_read, self.released = np.array(first_read), np.array(released)
        self.gradient_bytes = np.cumsum(gradients)[:steps]

    def _held(self, values: np.ndarray, since) -> np.ndarray:
        """Bytes held at each backward step by `values` (a mask), each from step `since` until released."""
        change = np.bincount(np.broadcast_to(since, values.shape)[values], self.nbytes[values], self.steps + 1)
        change -= np.bincount(self.released[values] + 1, self.nbytes[values], self.steps + 2)[:self.steps + 1]
        return np.cumsum(change.astype(np.int64))[:self.steps]  # integral weights: exact in float64

    def segment(self, start: int, stop: int, crossing_start: np.ndarray) -> tuple[int, int, int]:
        """The segment [start, stop) by itself: (the peak while the backward pass runs its operations, of
        the gradients, the values crossing `start` (mask `crossing_start`), its values crossing `stop`
        and those it recomputes, from the first VJP that reads one; the bytes crossing `start` last
        read in it, held on while the segments before it run; the values it leaves to recompute)."""
        inside = (self.made >= start) & (self.made < stop)
        kept = inside & (self.last_read >= stop)
        recomputed = inside & ~kept & (self.first_read < self.steps)
        first = self.first_read[recomputed].min(initial=self.steps)
        memory = self.gradient_bytes + self._held(crossing_start | kept, 0) + self._held(recomputed, first)
        peak = int(memory[inside].max(initial=0))  # the steps that run this segment's operations
        return peak, int(self.nbytes[crossing_start & (self.last_read < stop)].sum()), int((inside & ~kept).sum())


def choose_boundaries(candidates: list[int], profile: TapeProfile, length: int) -> list[int]:
    """The subset of `candidates` (tape indices in 1..`length` - 1) with the lowest peak by the model of
    `profile`, then the fewest values left to recompute.

    While the backward pass runs segment j, the memory held is its own (`TapeProfile.segment`: it
    depends on its two ends only) plus the values that crossed an earlier boundary and are last
    read in an earlier segment k < j (held from the forward pass until segment k runs, after j).
    Those add up over the segments before j, so the best plan from a boundary on is found from the
    end of the tape backwards: best(b) = min over the next boundary c of max(segment(b, c),
    carried(b, c) + best(c))."""
    points = [0, *candidates, length]
    best = {len(points) - 1: (0, 0, None)}  # from the end: no segment left
    for i in range(len(points) - 2, -1, -1):
        crossing = (profile.made < points[i]) & (profile.last_read >= points[i])
        options = []
        for k in range(i + 1, len(points)):
            peak, carried, recomputed = profile.segment(points[i], points[k], crossing)
            later_peak, later_recomputed, _ = best[k]
            if k < len(points) - 1:
                peak = max(peak, carried + later_peak)
            options.append((peak, recomputed + later_recomputed, k))
        best[i] = min(options)
    plan, i = [], best[0][2]
    while i < len(points) - 1:
        plan.append(points[i])
        i = best[i][2]
    return plan


class _Snapshot(NamedTuple):
    values: dict  # Node -> value: every recorded value alive at the boundary
    made: np.ndarray  # their tape indices, sorted
    bytes_from: np.ndarray  # bytes_from[i]: bytes of the values made at made[i] or later (a 0 ends it)
    saved_before: int  # bytes the plain engine had saved for VJPs before the boundary

    def bytes_made_from(self, indices: np.ndarray) -> np.ndarray:
        """Bytes of the values made at each of `indices` or later."""
        return self.bytes_from[np.searchsorted(self.made, indices)]


class SqrtSegments:
    """The forward pass's side of "sqrt": which boundaries to keep snapshots at while the tape grows.

    Boundary b lies between the operations with tape indices b - 1 and b. A value crosses it when
    an operation before b made it and one from b on reads it. While recording, the future readers
    are unknown, but every value that can still be read has a live `Tracer`: the recorded values
    whose tracers are alive are a superset of those crossing, and their bytes are known at once.
    Each boundary where those bytes reach a local minimum (between a loop's steps rather than
    inside one, where temporaries are alive too) is committed with those values.

    The snapshots cost memory from the forward pass on, so they are cut (`_replan`) whenever their
    distinct bytes grow by GROWTH past those at the last cut, or past the estimated peak then: to
    the boundaries of the best plans, by the estimate below, for the tape so far and for it
    continued (its saved bytes grown by the shares in FUTURES, in one more segment: plans that keep
    fewer bytes crossing, as a longer tape needs), and then the boundaries that add the fewest
    bytes to those, up to SPARE of the estimated peak. Once the tape is complete, `settle` chooses
    among the boundaries kept with a finer model, of the backward pass itself (`choose_boundaries`).

    The estimate: the backward pass runs the segments last to first, each holding the values
    crossing its boundary and every earlier one and what it saves for its VJPs (the distinct bytes
    the plain engine saves over its operations, counted as they are first read). A tracer lives
    for one span of the tape, so the bytes a boundary adds to those of the previous one are those of
    the values made after it, and the best plan follows from the end backwards.
    """

    GROWTH = 0.05
    FUTURES = (0.5, 2.0)
    SPARE = 0.05

    def __init__(self, xp, ledger):
        self.xp, self.ledger = xp, ledger
        self.length = 0  # operations recorded
        self.alive: dict = {}  # Node -> weak reference to its Tracer, while the tracer exists
        self.alive_bytes = 0
        self.nbytes: dict = {}  # Node -> bytes of its value, for every recorded value
        self.read: set = set()  # the recorded values some VJP reads: those the plain engine saves
        self.saved_bytes = 0  # their bytes
        self.snapshots: dict[int, _Snapshot] = {}  # boundary -> its snapshot
        self.snapshot_bytes = 0  # distinct bytes the snapshots hold
        self.limit = 0  # snapshot bytes past which they are cut again
        self.previous_alive_bytes = 0  # at the previous boundary offered
        self.pending: tuple[int, int, dict] | None = None  # (boundary, bytes alive, values): a minimum so far

    def offer(self, index: int) -> None:
        """Operation `index` is about to be recorded: boundary `index` is a candidate."""
        self.length = index + 1
        if index == 0:
            return
        if self.pending is not None and self.alive_bytes >= self.pending[1]:
            self._commit()
            if self.snapshot_bytes > self.limit:
                self._replan()
        if self.alive_bytes <= self.previous_alive_bytes:  # not rising: a minimum, until a lower one comes
            if self.pending is not None:
                self._release(self.pending[2])
            values = {node: ref().value for node, ref in self.alive.items()}
            for value in values.values():
                self.ledger.acquire(value)
            self.pending = (index, self.alive_bytes, values)
        self.previous_alive_bytes = self.alive_bytes

    def watch(self, tracer, reads: list) -> None:
        """Count `tracer`'s value as alive (readable by later operations) until the tracer is gone, and
        the values its operation's VJPs read (`reads`: Nodes) among those the plain engine saves."""
        node = tracer.node
        nbytes = self.nbytes[node] = self.xp.storage(tracer.value)[1]
        alive = self.alive

        def gone(_, node=node):
            if alive.pop(node, None) is not None:
                self.alive_bytes -= nbytes

        alive[node] = weakref.ref(tracer, gone)
        self.alive_bytes += nbytes
        for read in reads:
            if read not in self.read:
                self.read.add(read)
                self.saved_bytes += self.nbytes[read]

    def _commit(self) -> None:
        """Add the pending boundary's snapshot."""
        index, _, values = self.pending
        self.pending = None
        sizes = sorted((node.index, self.nbytes[node]) for node in values)
        made = np.array([made for made, _ in sizes], dtype=np.int64)
        bytes_from = np.append(np.cumsum([size for _, size in reversed(sizes)], dtype=np.int64)[::-1], 0)
        previous = max(self.snapshots, default=0)
        self.snapshots[index] = snapshot = _Snapshot(values, made, bytes_from, self.saved_bytes)
        self.snapshot_bytes += int(snapshot.bytes_made_from(previous))

    def _replan(self) -> None:
        boundaries = sorted(self.snapshots)
        points = np.array([0, *boundaries])
        saved_before = np.array([0, *(self.snapshots[b].saved_before for b in boundaries)], dtype=np.int64)
        added = np.zeros((len(points), len(points)), dtype=np.int64)  # [i, k]: made from point i on, alive at k
        for k, boundary in enumerate(boundaries, 1):
            added[:k, k] = self.snapshots[boundary].bytes_made_from(points[:k])
        peaks, plans = self._plans(saved_before, added, np.array([0, *self.FUTURES]) * self.saved_bytes)
        keep = {0}.union(*plans)  # positions in points
        spare = self.SPARE * peaks[0]
        for extra, k in sorted(self._extra_bytes(added, sorted(keep))):
            if extra > spare:
                break
            keep.add(k)
            spare -= extra
        for k, boundary in enumerate(boundaries, 1):
            if k not in keep:
                self._release(self.snapshots.pop(boundary).values)
        kept = sorted(keep)
        self.snapshot_bytes = int(sum(added[i, k] for i, k in zip(kept, kept[1:])))
        self.limit = (1 + self.GROWTH) * max(peaks[0], self.snapshot_bytes)

    def _plans(self, saved_before: np.ndarray, added: np.ndarray, futures: np.ndarray) -> tuple[list, list]:
        """For each of `futures` (bytes the last segment will save besides those it has): the estimated
        peak of the best plan, and the positions of its boundaries among the points."""
        count = len(saved_before)
        best = np.zeros((len(futures), count), dtype=np.int64)  # the peak from point i on
        following = np.full((len(futures), count), count)  # the next boundary; count: none
        for i in range(count - 1, -1, -1):
            best[:, i] = self.saved_bytes + futures - saved_before[i]  # one segment to the end
            if i + 1 < count:
                options = np.maximum(saved_before[i + 1:] - saved_before[i], added[i, i + 1:] + best[:, i + 1:])
                choice = options.argmin(axis=1)
                lower = options[np.arange(len(futures)), choice] < best[:, i]
                following[lower, i] = i + 1 + choice[lower]
                best[lower, i] = options[lower, choice[lower]]
        plans = []
        for row in following:
            plan, i = [], int(row[0])
            while i < count:
                plan.append(i)
                i = int(row[i])
            plans.append(plan)
        return best[:, 0].tolist(), plans

    @staticmethod
    def _extra_bytes(added: np.ndarray, kept: list[int]) -> list[tuple[int, int]]:
        """(bytes it would add, position) of each point not in `kept` (sorted positions, from 0): the
        values alive at it made after the kept point before it, less those alive at the kept one after."""
        extras = []
        for k in range(1, len(added)):
            following = bisect.bisect_left(kept, k)
            if following < len(kept) and kept[following] == k:
                continue
            before = kept[following - 1]
            extra = added[before, k]
            if following < len(kept):
                after = kept[following]
                extra -= added[before, after] - added[k, after]  # made from `before` to k, alive at `after`
            extras.append((int(extra), k))
        return extras

    def _release(self, values: dict) -> None:
        for value in values.values():
            self.ledger.release(value)

    def settle(self, profile: TapeProfile) -> tuple[list[int], dict]:
        """The tape is complete: (boundaries, {Node: value} of every value crossing one). Of the committed
        boundaries, `choose_boundaries` picks those with the lowest peak by `profile`; of their
        snapshots only the values crossing them are kept, each holding one ledger reference, and
        the rest are let go."""
        if self.pending is not None:
            self._commit()
        boundaries = choose_boundaries(sorted(self.snapshots), profile, self.length)
        last_read = dict(zip(profile.nodes, profile.last_read.tolist()))
        kept = {}
        for boundary in boundaries:
            for node, value in self.snapshots[boundary].values.items():
                if node not in kept and last_read.get(node, -1) >= boundary:
                    kept[node] = value
                    self.ledger.acquire(value)
        self.discard()
        return boundaries, kept

    def discard(self) -> None:
        """Let go of every snapshot the forward pass kept (settled, or the backward pass never ran)."""
        self.alive.clear()  # recording is over: later deaths do not matter
        if self.pending is not None:
            self._release(self.pending[2])
            self.pending = None
        for snapshot in self.snapshots.values():
            self._release(snapshot.values)
        self.snapshots = {}
