"""The tape: traced values, graph nodes, the backward pass and its two accumulation strategies.

Tracing: each differentiated argument is wrapped in a `Tracer`; every primitive applied to a
tracer records a `Node` holding only what its VJPs need (inputs, output, or nothing but shapes).
Backward: nodes run in a dependency order (a node runs once all its consumers have run, so its
gradient is complete); after a node's VJPs have run, its gradient and saved values are dropped,
so that memory returns while the pass goes on.
"""

from __future__ import annotations

import bisect
import functools
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from benchlib.autodiff.backend import NUMPY, SUPPORTED_INPUTS, backend_of
from benchlib.autodiff.checkpoint import SqrtSegments, TapeProfile, check_policy, revolve_advance

ACCUMULATE_MODES = ("inplace", "deferred")


class Node:
    """One recorded operation (or a leaf: a differentiated argument, with no primitive)."""

    __slots__ = ("primitive", "parents", "args", "output", "shapes", "kwargs", "shape", "dtype", "index", "consts")

    def __init__(self, primitive, parents, args, output, shapes, kwargs, shape, dtype):
        self.index = -1  # position on the tape of the call that recorded it
        self.consts = None  # under checkpointing: the untraced arguments, to re-run the primitive
        self.primitive = primitive
        self.parents = parents  # ((argument position, parent Node), ...) for traced arguments only
        self.args = args
        self.output = output
        self.shapes = shapes
        self.kwargs = kwargs
        self.shape = shape
        self.dtype = dtype

    @classmethod
    def leaf(cls, shape, dtype) -> "Node":
        return cls(None, (), None, None, (), {}, shape, dtype)

    @property
    def is_leaf(self) -> bool:
        return self.primitive is None

    def take_saved(self) -> "Saved":
        """Hand the saved values to the VJPs and forget them here, so they die with the VJPs."""
        saved = Saved(self.args, self.output, self.shapes, self.kwargs)
        self.args = self.output = None
        return saved


class Saved(NamedTuple):
    """What a VJP sees: inputs and output (None unless the primitive saves them), shapes, kwargs."""

    args: tuple | None
    output: object
    shapes: tuple
    kwargs: dict


class Tracer:
    """A value being differentiated: the raw array, the node that made it, and its backend.

    Operators (`+ - * / @ **`, unary `-`) are attached by `benchlib.autodiff.ops`.
    """

    __slots__ = ("value", "node", "backend", "__weakref__")  # weak references: "sqrt" sees which values can still be read
    __array_ufunc__ = None  # `ndarray + tracer` defers to Tracer.__radd__ instead of looping
    __array_priority__ = 1000

    def __init__(self, value, node: Node, backend):
        self.value = value
        self.node = node
        self.backend = backend

    @property
    def shape(self) -> tuple:
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    @property
    def dtype(self):
        return self.value.dtype

    def __repr__(self) -> str:
        return f"Tracer(shape={self.shape}, dtype={self.dtype}, library={self.backend.name})"


class Primitive:
    """An operation with a forward function and one VJP per argument position.

    `forward(xp, *args, **kwargs)` computes on raw arrays; `vjps[i](xp, g, saved)` returns the
    gradient contribution for argument i in the output's (broadcast) shape; the engine reduces it
    to the argument's shape and dtype. `vjps[i] = None` marks a non-differentiable argument.
    `save` names what the VJPs read: "inputs", "output", both, or nothing (shapes only).
    """

    def __init__(self, name: str, forward: Callable, vjps: tuple, save: tuple[str, ...] = ()):
        unknown = set(save) - {"inputs", "output"}
        if unknown:
            raise ValueError(f"save may hold 'inputs' and 'output'; got {sorted(unknown)}")
        self.name = name
        self.forward = forward
        self.vjps = vjps
        self.save_inputs = "inputs" in save
        self.save_output = "output" in save

    def __call__(self, *args, **kwargs):
        traced = [a for a in args if isinstance(a, Tracer)]
        if traced:
            xp = traced[0].backend
            dtype = xp.promote([t.value.dtype for t in traced])
        else:
            xp, dtype = _raw_backend_and_dtype(args)
        raw = []
        for position, arg in enumerate(args):
            if isinstance(arg, Tracer):
                if self.vjps[position] is None:
                    raise TypeError(
                        f"{self.name}: argument {position} cannot be differentiated; pass a constant there"
                    )
                raw.append(arg.value)
            elif self.vjps[position] is None:  # e.g. integer labels: no dtype rule applies
                raw.append(arg)
            else:
                raw.append(_constant(xp, arg, dtype, self.name))
        output = xp.normalize(self.forward(xp, *raw, **kwargs))
        if not traced:
            return output
        node = Node(
            primitive=self,
            parents=tuple((i, a.node) for i, a in enumerate(args) if isinstance(a, Tracer)),
            args=tuple(raw) if self.save_inputs else None,
            output=output if self.save_output else None,
            shapes=tuple(tuple(getattr(a, "shape", ())) for a in raw),
            kwargs=kwargs,
            shape=tuple(output.shape),
            dtype=output.dtype,
        )
        tracer = Tracer(output, node, xp)
        recorder = getattr(_RECORDING, "current", None)
        if recorder is not None:
            recorder.record(node, raw, tracer)
        return tracer

    def __repr__(self) -> str:
        return f"Primitive({self.name})"


def _raw_backend_and_dtype(args):
    """Outside tracing: the library of the array arguments, and the dtype 0-d constants take
    (that of the arrays with at least one dimension; None leaves the library's own rules)."""
    arrays = [a for a in args if backend_of(a) is not None]
    if not arrays:
        return NUMPY, None
    xp = backend_of(arrays[0])
    shaped = [a.dtype for a in arrays if len(a.shape) > 0]
    return xp, (xp.promote(shaped) if shaped else None)


def _constant(xp, value, dtype, op_name: str):
    if xp.foreign(value):
        raise TypeError(
            f"{op_name}: a {type(value).__module__}.{type(value).__name__} constant in a {xp.name} "
            f"computation; convert it yourself (no data moves between libraries or devices)"
        )
    return value if dtype is None else xp.coerce_scalar(value, dtype)


@dataclass
class BackwardStats:
    """Exact counters of the gradient memory the engine holds during one backward pass.

    A gradient buffer is counted by the nbytes of its memory block when the engine first holds
    it (a seed, a VJP's contribution once reduced to its input's shape, an accumulation buffer)
    and uncounted when the engine lets go of it; views and repeated references to one block count
    once. Temporaries inside a single VJP are not counted. Leaf gradients are held until they are
    handed back, so `live_bytes` is 0 once a call has returned.

    Forward values held for the backward pass (`saved_bytes`) are counted the same way: the
    outputs of recorded operations that a VJP will read, from the moment they are saved (or, under
    checkpointing, kept or recomputed) until the VJPs that read them have run. The differentiated
    arguments and constants belong to the caller and are not counted. `peak_total_bytes` is the
    largest sum of both at one instant (`saved_bytes_at_peak_total` and `live_bytes_at_peak_total` its
    two parts then); `recomputed_nodes` counts operations re-run under checkpointing.
    """

    accumulate: str
    checkpoint: str = "none"
    library: str = ""
    device: str = ""
    dtype: str = ""
    live_bytes: int = 0
    peak_bytes: int = 0
    saved_bytes: int = 0
    saved_bytes_peak: int = 0
    peak_total_bytes: int = 0
    saved_bytes_at_peak_total: int = 0  # the two roles of peak_total_bytes, at its instant
    live_bytes_at_peak_total: int = 0
    recomputed_nodes: int = 0
    nodes_run: int = 0  # operations whose VJPs ran
    vjp_calls: int = 0  # one per (operation, traced argument)
    buffers_created: int = 0  # accumulation buffers the engine allocated
    inplace_adds: int = 0  # contributions added into such a buffer in place
    live_bytes_after_node: list[int] = field(default_factory=list)
    saved_bytes_after_node: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class _Ledger:
    """Counts live bytes by memory block, so aliases and views count once: gradient buffers
    (`role="live"`: live_bytes, peak_bytes) or saved forward values (`role="saved"`)."""

    def __init__(self, xp, stats: BackwardStats, role: str = "live"):
        self.xp = xp
        self.stats = stats
        self.current, self.peak = ("live_bytes", "peak_bytes") if role == "live" else ("saved_bytes", "saved_bytes_peak")
        self.blocks: dict[int, list[int]] = {}  # key -> [references, nbytes]

    def _add(self, nbytes: int) -> None:
        stats = self.stats
        value = getattr(stats, self.current) + nbytes
        setattr(stats, self.current, value)
        if value > getattr(stats, self.peak):
            setattr(stats, self.peak, value)
        total = stats.live_bytes + stats.saved_bytes
        if total > stats.peak_total_bytes:
            stats.peak_total_bytes = total
            stats.saved_bytes_at_peak_total, stats.live_bytes_at_peak_total = stats.saved_bytes, stats.live_bytes

    def acquire(self, value) -> None:
        key, nbytes = self.xp.storage(value)
        entry = self.blocks.get(key)
        if entry is not None:
            entry[0] += 1
            return
        self.blocks[key] = [1, nbytes]
        self._add(nbytes)

    def release(self, value) -> None:
        key, _ = self.xp.storage(value)
        entry = self.blocks[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.blocks[key]
            self._add(-entry[1])


class _InPlace:
    """First contribution kept as it is (it may alias a caller's array or another node's
    gradient, so it is never written to); the second makes a fresh buffer; later ones are
    added into that buffer in place."""

    def __init__(self, xp, ledger: _Ledger, stats: BackwardStats):
        self.xp, self.ledger, self.stats = xp, ledger, stats
        self.slots: dict[Node, list] = {}  # node -> [gradient, engine owns it]

    def add(self, node: Node, contribution) -> None:
        self.ledger.acquire(contribution)
        slot = self.slots.get(node)
        if slot is None:
            self.slots[node] = [contribution, False]
            return
        if slot[1]:
            self.xp.add_inplace(slot[0], contribution)
            self.stats.inplace_adds += 1
        else:
            buffer = self.xp.add(slot[0], contribution)
            self.ledger.acquire(buffer)
            self.stats.buffers_created += 1
            self.ledger.release(slot[0])
            slot[0], slot[1] = buffer, True
        self.ledger.release(contribution)

    def take(self, node: Node):
        return self.slots.pop(node)[0]

    def finish(self) -> None:
        """Nothing is left: every slot was taken when its node ran."""


class _Deferred:
    """Every contribution, to every node, kept in a list until the backward pass ends; a node's
    gradient is their sum, made when its VJPs need it and dropped after them. This is autograd's
    behaviour before its issue #219 (and #221): kept to be measured against."""

    def __init__(self, xp, ledger: _Ledger, stats: BackwardStats):
        self.xp, self.ledger, self.stats = xp, ledger, stats
        self.slots: dict[Node, list] = {}

    def add(self, node: Node, contribution) -> None:
        self.ledger.acquire(contribution)
        self.slots.setdefault(node, []).append(contribution)

    def take(self, node: Node):
        contributions = self.slots[node]
        if len(contributions) == 1:
            total = contributions[0]
        else:
            total = self.xp.add(contributions[0], contributions[1])
            self.stats.buffers_created += 1
            for contribution in contributions[2:]:
                self.xp.add_inplace(total, contribution)
                self.stats.inplace_adds += 1
        self.ledger.acquire(total)
        return total

    def finish(self) -> None:
        """The backward pass has ended: let go of every kept contribution."""
        for contributions in self.slots.values():
            for contribution in contributions:
                self.ledger.release(contribution)
        self.slots.clear()


_ACCUMULATORS = {"inplace": _InPlace, "deferred": _Deferred}


def _fit(xp, contribution, node: Node):
    """A contribution reduced to its input's shape (undoing broadcasting) and dtype."""
    contribution = xp.normalize(contribution)
    shape = tuple(contribution.shape)
    if shape != node.shape:
        lead = len(shape) - len(node.shape)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, n in enumerate(node.shape) if n == 1 and shape[lead + i] != 1
        )
        contribution = xp.reshape(xp.sum(contribution, axis=axes, keepdims=True), node.shape)
    if contribution.dtype != node.dtype:
        contribution = xp.astype(contribution, node.dtype)
    return contribution


def _count_consumers(output: Node) -> dict[Node, int]:
    """For every node the output depends on, how many edges lead to it from nodes that do."""
    consumers: dict[Node, int] = {}
    stack = [output]
    seen = {output}
    while stack:
        node = stack.pop()
        for _, parent in node.parents:
            consumers[parent] = consumers.get(parent, 0) + 1
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return consumers


def backward_order(output: Node) -> list[Node]:
    """The operations the backward pass runs, in its order: an operation runs once all its consumers
    have (its gradient is then complete), the latest ready first. A function of the graph alone, so
    a checkpoint policy can plan on it before the pass starts."""
    if output.is_leaf:
        return []
    remaining = _count_consumers(output)
    order, ready = [], [output]
    while ready:
        node = ready.pop()
        order.append(node)
        for _, parent in node.parents:
            remaining[parent] -= 1
            if remaining[parent] == 0 and not parent.is_leaf:
                ready.append(parent)
    return order


def backward(xp, ledger: _Ledger, output: Node, seed, leaves: dict[Node, int], accumulate: str, on_leaf_grad,
             values: "_SavedValues | _Checkpointed"):
    """Run the backward pass from `output` in `backward_order`; return {leaf: final gradient} for reached leaves.

    `values.saved_for(node)` gives a node's VJPs what they read (kept, or recomputed under a
    checkpoint policy); `values.done(node)` lets go of it once they have run.

    `accumulator.take(node)` hands out the node's complete gradient holding one ledger reference,
    which is released once the node's VJPs have run (or, for a leaf, when it is handed back).

    A leaf's gradient is final when its last consumer has run, and `on_leaf_grad(index, gradient)`
    is called then.
    """
    stats = ledger.stats
    accumulator = _ACCUMULATORS[accumulate](xp, ledger, stats)
    remaining = _count_consumers(output)
    final: dict[Node, object] = {}

    def complete_leaf(node: Node) -> None:
        gradient = final[node] = accumulator.take(node)
        if on_leaf_grad is not None:
            on_leaf_grad(leaves[node], gradient)

    order = backward_order(output)
    values.begin(order)
    accumulator.add(output, seed)
    del seed
    if output.is_leaf:
        complete_leaf(output)
    for node in order:
        gradient = accumulator.take(node)
        saved = values.saved_for(node)
        vjps = node.primitive.vjps
        for position, parent in node.parents:
            contribution = _fit(xp, vjps[position](xp, gradient, saved), parent)
            stats.vjp_calls += 1
            accumulator.add(parent, contribution)
            del contribution  # the accumulator decides how long it lives
            remaining[parent] -= 1
            if remaining[parent] == 0:
                del remaining[parent]
                if parent.is_leaf:
                    complete_leaf(parent)
        del saved
        values.done(node)
        ledger.release(gradient)
        del gradient
        stats.nodes_run += 1
        stats.live_bytes_after_node.append(stats.live_bytes)
        stats.saved_bytes_after_node.append(stats.saved_bytes)
    accumulator.finish()
    return final


_RECORDING = threading.local()  # .current: the recorder of the call being traced in this thread


def _held_values(node: Node, raw: list, output) -> list:
    """The recorded values `node`'s VJPs read: its traced non-leaf inputs if it saves inputs, its output if it saves that."""
    held = [raw[position] for position, parent in node.parents if not parent.is_leaf] if node.primitive.save_inputs else []
    if node.primitive.save_output:
        held.append(output)
    return held


class _SavedValues:
    """The plain engine's forward values: each node keeps what its VJPs read (Node.args/output);
    the ledger counts the recorded outputs among them from the forward pass until the VJPs ran."""

    def __init__(self, xp, ledger: _Ledger):
        self.xp, self.ledger = xp, ledger
        self.held: dict[Node, list] = {}
        self.tape_length = 0

    def record(self, node: Node, raw: list, tracer: Tracer) -> None:
        node.index = self.tape_length
        self.tape_length += 1
        held = _held_values(node, raw, tracer.value)
        for value in held:
            self.ledger.acquire(value)
        if held:
            self.held[node] = held

    def begin(self, order: list[Node]) -> None:
        """The backward pass starts: nothing to prepare, every node holds its values."""

    def saved_for(self, node: Node) -> "Saved":
        return node.take_saved()

    def done(self, node: Node) -> None:
        for value in self.held.pop(node, ()):
            self.ledger.release(value)

    def finish(self) -> None:
        """The backward pass has ended: values saved by operations it never reached are not held for it."""
        for node in list(self.held):
            self.done(node)


class _Checkpointed:
    """Forward values under a checkpoint policy (benchlib.autodiff.checkpoint): nodes keep none,
    snapshots are kept by the policy, the rest is recomputed from the tape when a VJP needs it.

    "sqrt" recomputes one segment between boundaries at a time, from the values crossing its
    start: every value of it that a VJP still to run reads is kept until read, the others are
    let go as soon as the recomputation has used them. A budget recomputes the ancestors of the
    value needed, keeping Revolve's snapshots on the way."""

    def __init__(self, xp, ledger: _Ledger, policy, leaves: dict):
        self.xp, self.ledger, self.policy = xp, ledger, policy
        self.leaf_values = leaves  # leaf Node -> the caller's array (not counted)
        self.kept: dict[Node, object] = {}  # snapshots and recomputed values, until no VJP or recomputation needs them
        self.segments = SqrtSegments(xp, ledger) if policy == "sqrt" else None
        self.boundaries: list[int] = []
        self.tape: list[Node] = []  # the nodes the backward pass will run, in tape order (for "sqrt")
        self.tape_indices: list[int] = []
        self.tape_length = 0
        self.temporaries: dict[Node, list] = {}
        self.consumers: dict[Node, list[Node]] = {}
        self.unrun_consumers: dict[Node, int] = {}
        self.ran: set[Node] = set()

    def begin(self, order: list[Node]) -> None:
        """Find each node's consumers among the nodes the backward pass will run, so a kept value goes as
        soon as nothing left to run can need it; under "sqrt", settle the boundaries and their
        snapshots on the complete tape."""
        for node in order:
            for _, parent in node.parents:
                self.consumers.setdefault(parent, []).append(node)
        self.unrun_consumers = {node: len(consumers) for node, consumers in self.consumers.items()}
        if self.segments is not None:
            leaf_bytes = {leaf: self.xp.storage(value)[1] for leaf, value in self.leaf_values.items()}
            profile = TapeProfile(order, self.consumers, self.segments.nbytes, leaf_bytes)
            self.boundaries, self.kept = self.segments.settle(profile)
            self.tape = sorted(order, key=lambda n: n.index)
            self.tape_indices = [node.index for node in self.tape]

    def record(self, node: Node, raw: list, tracer: Tracer) -> None:
        node.index = self.tape_length
        self.tape_length += 1
        traced = {position for position, _ in node.parents}
        node.consts = tuple(None if position in traced else value for position, value in enumerate(raw))
        node.args = node.output = None
        if self.segments is not None:
            self.segments.offer(node.index)
            reads = [parent for _, parent in node.parents if not parent.is_leaf] if node.primitive.save_inputs else []
            self.segments.watch(tracer, reads + [node] if node.primitive.save_output else reads)

    def _value(self, node: Node, computed: dict):
        if node.is_leaf:
            return self.leaf_values[node]
        if node in computed:
            return computed[node]
        return self.kept[node]

    def _run(self, node: Node, computed: dict):
        """Re-run `node`'s primitive on its parents' values (counted as held and as recomputed)."""
        args = list(node.consts)
        for argument, parent in node.parents:
            args[argument] = self._value(parent, computed)
        value = self.xp.normalize(node.primitive.forward(self.xp, *args, **node.kwargs))
        self.ledger.acquire(value)
        self.ledger.stats.recomputed_nodes += 1
        return value

    def _read_later(self, node: Node) -> bool:
        """Will a VJP still to run read `node`'s value (its own, or a consumer's that saves inputs)?"""
        if node.primitive.save_output and node not in self.ran:
            return True
        return any(c.primitive.save_inputs and c not in self.ran for c in self.consumers.get(node, ()))

    def _recompute_segment(self, target: Node) -> None:
        """Recompute the segment holding `target` from the values crossing its start: keep each value
        a VJP still to run reads, drop the others once the recomputation no longer needs them."""
        following = bisect.bisect_right(self.boundaries, target.index)
        start = self.boundaries[following - 1] if following else 0
        stop = self.boundaries[following] if following < len(self.boundaries) else self.tape_length
        segment = self.tape[bisect.bisect_left(self.tape_indices, start):bisect.bisect_left(self.tape_indices, stop)]
        wanted = {node for node in segment if node not in self.kept and self._read_later(node)}
        needed, stack = set(), list(wanted)
        while stack:
            node = stack.pop()
            if node in needed or node.is_leaf or node in self.kept:
                continue  # a parent before `start` crosses it: it is kept
            needed.add(node)
            stack.extend(parent for _, parent in node.parents)
        order = [node for node in segment if node in needed]
        uses = {node: 0 for node in order}
        for node in order:
            for _, parent in node.parents:
                if parent in uses:
                    uses[parent] += 1
        computed: dict[Node, object] = {}
        for node in order:
            value = self._run(node, computed)
            if node in wanted:
                self.kept[node] = value
            else:
                computed[node] = value
            for _, parent in node.parents:
                if parent in uses:
                    uses[parent] -= 1
                    if uses[parent] == 0 and parent in computed:
                        self.ledger.release(computed.pop(parent))

    def _keep_positions(self, count: int) -> set[int]:
        """Which of `count` recomputed values (in tape order; the last is the one needed now) a budget keeps."""
        free = self.policy - len(self.kept)
        keep, done, steps = set(), 0, count + 1  # reversing the node after the target: count + 1 steps
        while free > 0 and steps - done > 1:
            done += revolve_advance(steps - done, free)
            keep.add(done - 1)
            free -= 1
        return keep

    def _recompute_ancestors(self, target: Node) -> object:
        """Under a budget: recompute `target`'s unkept ancestors in tape order, keeping Revolve's
        snapshots; returns target's value (one ledger reference, for the caller to drop)."""
        needed, stack = set(), [target]
        while stack:
            node = stack.pop()
            if node in needed or node.is_leaf or node in self.kept:
                continue
            needed.add(node)
            stack.extend(parent for _, parent in node.parents)
        order = sorted(needed, key=lambda n: n.index)
        uses = {node: 0 for node in order}
        for node in order:
            for _, parent in node.parents:
                if parent in uses:
                    uses[parent] += 1
        keep = self._keep_positions(len(order))
        computed: dict[Node, object] = {}
        for position, node in enumerate(order):
            value = computed[node] = self._run(node, computed)
            if position in keep:
                self.kept[node] = value
                self.ledger.acquire(value)
            for _, parent in node.parents:
                if parent in uses:
                    uses[parent] -= 1
                    if uses[parent] == 0 and parent is not target:
                        self.ledger.release(computed.pop(parent))
        return computed.pop(target)  # every other recomputed value was kept or released with its last use

    def materialize(self, target: Node) -> tuple[object, list]:
        """The value of `target`; (value, values to drop once the caller's VJPs have run)."""
        if target.is_leaf or target in self.kept:
            return self._value(target, {}), []
        if self.segments is not None:
            self._recompute_segment(target)
            return self.kept[target], []
        value = self._recompute_ancestors(target)
        return value, [value]

    def saved_for(self, node: Node) -> "Saved":
        temporaries = []
        args = None
        if node.primitive.save_inputs:
            args = list(node.consts)
            for position, parent in node.parents:
                args[position], dropped = self.materialize(parent)
                temporaries += dropped
            args = tuple(args)
        output = None
        if node.primitive.save_output:
            output, dropped = self.materialize(node)
            temporaries += dropped
        self.temporaries[node] = temporaries
        return Saved(args, output, node.shapes, node.kwargs)

    def _release_if_unneeded(self, node: Node) -> None:
        """A kept value is needed while a consumer has not run (its input, or an ancestor of a value
        still to recompute), and until its own node ran if that node's VJPs read its output."""
        if node in self.kept and not self.unrun_consumers.get(node) and (
                node in self.ran or not node.primitive.save_output):
            self.ledger.release(self.kept.pop(node))

    def finish(self) -> None:
        """The backward pass has ended (or never ran): snapshots of operations it never reached are let go."""
        if self.segments is not None:
            self.segments.discard()
        for node in list(self.kept):
            self.ledger.release(self.kept.pop(node))

    def done(self, node: Node) -> None:
        for value in self.temporaries.pop(node, ()):
            self.ledger.release(value)
        self.ran.add(node)
        self._release_if_unneeded(node)
        for _, parent in node.parents:
            if parent in self.unrun_consumers:
                self.unrun_consumers[parent] -= 1
                self._release_if_unneeded(parent)


def _check_argnum(argnum) -> tuple[int, ...]:
    def valid(i):
        return isinstance(i, int) and not isinstance(i, bool) and i >= 0

    if valid(argnum):
        return (argnum,)
    if isinstance(argnum, tuple) and argnum and all(valid(i) for i in argnum):
        if len(set(argnum)) != len(argnum):
            raise ValueError(f"argnum {argnum} repeats an argument; each index may appear once")
        return argnum
    raise TypeError(f"argnum must be a non-negative int or a non-empty tuple of them; got {argnum!r}")


class GradientFunction:
    """What `grad` and `value_and_grad` return. `.stats` is the `BackwardStats` of the current
    or latest call (a new object per call, updated live during the backward pass)."""

    def __init__(self, fun: Callable, argnum, accumulate: str, on_leaf_grad, with_value: bool, checkpoint=None):
        check_policy(checkpoint)
        if accumulate not in ACCUMULATE_MODES:
            raise ValueError(
                f"accumulate must be one of {', '.join(repr(m) for m in ACCUMULATE_MODES)}; got {accumulate!r}"
            )
        if not callable(fun):
            raise TypeError(f"fun must be callable; got {type(fun).__name__}")
        if on_leaf_grad is not None and not callable(on_leaf_grad):
            raise TypeError(f"on_leaf_grad must be callable(index, gradient) or None; got {on_leaf_grad!r}")
        self.fun = fun
        self.argnum = argnum
        self.argnums = _check_argnum(argnum)
        self.accumulate = accumulate
        self.on_leaf_grad = on_leaf_grad
        self.with_value = with_value
        self.checkpoint = checkpoint
        self.stats: BackwardStats | None = None
        functools.update_wrapper(self, fun, updated=())

    def _inputs(self, args):
        """The differentiated arguments, checked, and their common backend."""
        for index in self.argnums:
            if index >= len(args):
                raise ValueError(
                    f"argnum {index} is out of range for a call with {len(args)} positional "
                    f"argument(s) (valid: 0..{len(args) - 1})"
                )
        inputs, backends = [], []
        for index in self.argnums:
            value = args[index]
            if isinstance(value, Tracer):
                raise TypeError(
                    f"argument {index} is already being differentiated: grad inside grad "
                    f"(higher-order gradients) is not supported"
                )
            if isinstance(value, np.generic):
                value = np.asarray(value)
            xp = backend_of(value)
            if xp is None or not xp.is_floating(value):
                kind = type(value).__name__ if xp is None else f"{type(value).__name__} of dtype {value.dtype}"
                raise TypeError(f"argument {index} is a {kind}; grad differentiates {SUPPORTED_INPUTS}")
            inputs.append(value)
            backends.append(xp)
        if any(xp is not backends[0] for xp in backends):
            libraries = ", ".join(f"argument {i}: {xp.name}" for i, xp in zip(self.argnums, backends))
            raise TypeError(f"differentiated arguments must use one array library; got {libraries}")
        return inputs, backends[0]

    def __call__(self, *args, **kwargs):
        inputs, xp = self._inputs(args)
        stats = self.stats = BackwardStats(
            self.accumulate, "none" if self.checkpoint is None else str(self.checkpoint), xp.name,
            xp.device(inputs[0]), str(inputs[0].dtype).replace("torch.", "")
        )
        with xp.no_grad():
            leaves = {Node.leaf(tuple(v.shape), v.dtype): index for index, v in zip(self.argnums, inputs)}
            ledger, saved_ledger = _Ledger(xp, stats), _Ledger(xp, stats, role="saved")
            if self.checkpoint is None:
                values = _SavedValues(xp, saved_ledger)
            else:
                values = _Checkpointed(xp, saved_ledger, self.checkpoint, dict(zip(leaves, inputs)))
            traced = list(args)
            for leaf, value in zip(leaves, inputs):
                traced[leaves[leaf]] = Tracer(value, leaf, xp)
            _RECORDING.current = values
            try:
                out = self.fun(*traced, **kwargs)
            finally:
                _RECORDING.current = None
            del traced
            value, output_node = _unpack_output(out, xp)
            del out
            final = {}
            if output_node is not None:
                final = backward(
                    xp, ledger, output_node, xp.ones_like(value), leaves, self.accumulate, self.on_leaf_grad, values
                )
            values.finish()
            del values
            gradients = []
            for leaf, argument in zip(leaves, inputs):
                if leaf not in final:  # the output does not depend on this argument
                    gradient = final[leaf] = xp.zeros_like(argument)
                    ledger.acquire(gradient)
                    if self.on_leaf_grad is not None:
                        self.on_leaf_grad(leaves[leaf], gradient)
                gradients.append(final[leaf])
            _separate(xp, gradients, ledger)
            for gradient in gradients:
                ledger.release(gradient)
        result = gradients[0] if isinstance(self.argnum, int) else tuple(gradients)
        return (value, result) if self.with_value else result


def _unpack_output(out, xp):
    """(raw value, node) of what `fun` returned; node is None when it does not depend on the inputs."""
    if isinstance(out, Tracer):
        value, node = out.value, out.node
    elif xp.owns(out) or isinstance(out, (int, float, np.generic)):
        value, node = out, None
    else:
        raise TypeError(f"fun must return a scalar array (one element); got {type(out).__name__}")
    if isinstance(value, (int, float, np.generic)):
        return value, None
    if xp.size(value) != 1:
        raise ValueError(
            f"fun must return a scalar (an array with one element) to take its gradient; got shape {tuple(value.shape)}"
        )
    return value, node


def _separate(xp, gradients: list, ledger: _Ledger) -> None:
    """Gradients of different arguments can be one array (e.g. both sides of `x + y`); copy so
    that each returned gradient can be modified without touching another."""
    for j in range(1, len(gradients)):
        if any(xp.shares_memory(gradients[i], gradients[j]) for i in range(j)):
            copy = xp.copy(gradients[j])
            ledger.acquire(copy)
            ledger.release(gradients[j])
            gradients[j] = copy


def grad(fun: Callable, argnum=0, *, accumulate: str = "inplace", on_leaf_grad=None, checkpoint=None) -> GradientFunction:
    """The gradient of scalar-valued `fun` with respect to argument(s) `argnum`.

    An int `argnum` gives one gradient, a tuple gives a tuple. `accumulate` is "inplace" (the
    default) or "deferred". `on_leaf_grad(index, gradient)` is called as soon as the gradient of
    argument `index` is final, before the backward pass ends; treat that array as read-only.
    `checkpoint` trades time for memory: None keeps every forward value a VJP needs; "sqrt" keeps
    about √n snapshots of n operations; an int N keeps at most N with the binomial (Revolve)
    schedule. The rest is recomputed during the backward pass (benchlib.autodiff.checkpoint).
    """
    return GradientFunction(fun, argnum, accumulate, on_leaf_grad, with_value=False, checkpoint=checkpoint)


def value_and_grad(fun: Callable, argnum=0, *, accumulate: str = "inplace", on_leaf_grad=None,
                   checkpoint=None) -> GradientFunction:
    """Like `grad`, but the function returns `(value of fun, gradient)`."""
    return GradientFunction(fun, argnum, accumulate, on_leaf_grad, with_value=True, checkpoint=checkpoint)
