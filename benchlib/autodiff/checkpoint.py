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


class SqrtSnapshots:
    """The forward pass's snapshot choice for "sqrt": every `stride`-th operation, the stride doubling
    (and the kept set thinning) whenever more than 2·stride are kept."""

    def __init__(self):
        self.stride = 1

    def offer(self, node, value, kept: dict, ledger) -> None:
        """Keep `value` (output of `node`) in `kept` if the schedule says so (counted by `ledger`);
        thin `kept` when it grows past 2·stride."""
        if node.index % self.stride:
            return
        kept[node] = value
        ledger.acquire(value)
        if len(kept) > 2 * self.stride:
            self.stride *= 2
            for old in [n for n in kept if n.index % self.stride]:
                ledger.release(kept.pop(old))
