"""Gradient checkpointing: same gradients bit for bit, exact memory counters, Revolve's recomputation count,
and √n segments on graphs with fan-out, skips, shared weights and several outputs."""

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchlib.autodiff import ACCUMULATE_MODES, grad, ops, value_and_grad
from benchlib.autodiff.checkpoint import SqrtSegments, TapeProfile, revolve_cost, revolve_cost_closed_form
from benchlib.zoo import graph_shapes

from test_autodiff import PROGRAM_SEEDS, _dot_chain, _generate_program, _run_program

POLICIES = ("sqrt", 1, 2, 4)


def test_checkpoint_policy_is_checked_before_any_work():
    for bad in ("half", 0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r'checkpoint must be None, "sqrt" or an int >= 1'):
            grad(lambda x: ops.sum(x), checkpoint=bad)


def test_revolve_table_matches_griewanks_closed_form():
    for steps in range(1, 80):
        for snapshots in range(0, 10):
            assert revolve_cost(steps, snapshots) == revolve_cost_closed_form(steps, snapshots), (steps, snapshots)
    assert [revolve_cost(4, c) for c in (0, 1, 2, 3)] == [6, 4, 3, 3]


class _Node:
    """What the planner sees of a recorded operation: its tape index and what its VJP reads."""

    def __init__(self, index):
        self.index = index
        self.primitive = SimpleNamespace(save_inputs=True, save_output=False)


class _Tracer:
    """What SqrtSegments sees of a tracer: its node and value, and that it can be weakly referenced."""

    def __init__(self, node, value):
        self.node, self.value = node, value


def test_sqrt_snapshots_settle_on_exactly_the_values_crossing_their_boundary():
    """Values alive at a boundary are held while recording; settling keeps those read at or after it."""
    held = []
    ledger = SimpleNamespace(acquire=held.append, release=held.remove)
    segments = SqrtSegments(SimpleNamespace(storage=lambda value: (id(value), 8)), ledger)
    nodes = [_Node(i) for i in range(12)]
    consumers = {node: nodes[node.index + 1:node.index + 3] for node in nodes[:11]}  # each read by the next two
    consumers[nodes[4]] = [nodes[5]]  # but 4, read by 5 only
    tracers = {}
    for node in nodes:
        segments.offer(node.index)
        tracers[node.index] = _Tracer(node, np.zeros(1))
        segments.watch(tracers[node.index], [n for n in nodes if node in consumers.get(n, ())])
        tracers.pop(node.index - 2, None)  # each value stays readable for the next two operations
    gc.collect()
    profile = TapeProfile(nodes[::-1], consumers, {node: 8 for node in nodes}, {})
    boundaries, kept = segments.settle(profile)
    last_read = {node: max(c.index for c in readers) for node, readers in consumers.items()}
    expected = {node for node in nodes[:11] for b in boundaries if node.index < b <= last_read[node]}
    assert boundaries and set(kept) == expected
    assert len(held) == len(kept) and all(any(v is kept[n] for n in kept) for v in held)
    segments.discard()
    assert len(held) == len(kept)  # the kept values now belong to the backward pass


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_dot_chain_counters_are_exact_for_every_policy(library):
    """z_k = x @ z_(k-1), gradient w.r.t. x; the VJP of dot k reads z_(k-1), the output of dot k-1.
    Plain: the d-1 outputs z_1..z_(d-1) are held from the forward pass (x and z_0 are the caller's);
    the peak of everything adds 3 gradient blocks (the gradient passed back, x's and z's contributions).
    Budget N: N snapshots plus the two values alive while a recomputation advances; Revolve's count of
    recomputations. sqrt: each needed output not kept by the forward pass is recomputed exactly once."""
    size = 4
    rng = np.random.default_rng(3)
    x, z = (rng.standard_normal((size, size)) / size for _ in range(2))
    if library == "torch":
        x, z = torch.tensor(x), torch.tensor(z)
    block = size * size * 8
    for depth in range(2, 13):
        plain = grad(_dot_chain(depth))
        expected = np.asarray(plain(x, z))
        assert plain.stats.saved_bytes_peak == (depth - 1) * block
        assert plain.stats.peak_total_bytes == (depth + 2) * block
        assert plain.stats.recomputed_nodes == 0
        for policy in POLICIES:
            df = grad(_dot_chain(depth), checkpoint=policy)
            np.testing.assert_array_equal(np.asarray(df(x, z)), expected)
            stats = df.stats
            assert stats.saved_bytes == 0 and stats.live_bytes == 0
            if policy == "sqrt":  # exact figures per shape: test_sqrt_segments_on_graph_shapes
                assert stats.recomputed_nodes <= depth - 1  # each needed output of dots 0..d-2 at most once
                assert stats.peak_total_bytes < plain.stats.peak_total_bytes or depth < 7
            else:
                assert stats.recomputed_nodes == revolve_cost(depth, policy), (depth, policy)
                assert stats.saved_bytes_peak == min(policy + 2, depth - 1) * block, (depth, policy)
                assert stats.peak_total_bytes == stats.saved_bytes_peak + 3 * block


@pytest.mark.parametrize("seed", PROGRAM_SEEDS)
def test_random_programs_give_the_same_gradients_under_every_policy(seed):
    program, inputs = _generate_program(seed)

    def fun(*args):
        return _run_program(program, args)

    plain_function = value_and_grad(fun, (0, 1, 2))
    plain_value, plain = plain_function(*inputs)
    assert plain_function.stats.saved_bytes == 0
    for policy in POLICIES:
        for mode in ACCUMULATE_MODES:
            df = value_and_grad(fun, (0, 1, 2), accumulate=mode, checkpoint=policy)
            value, grads = df(*inputs)
            assert value == plain_value
            for g, p in zip(grads, plain):
                np.testing.assert_array_equal(g, p, err_msg=f"{policy} {mode} {program}")
            assert df.stats.saved_bytes == 0 and df.stats.live_bytes == 0


@pytest.mark.parametrize("seed", range(0, 40, 8))
def test_random_programs_on_torch_tensors_under_checkpointing(seed):
    program, inputs = _generate_program(seed)
    tensors = [torch.tensor(x) for x in inputs]

    def fun(*args):
        return _run_program(program, args)

    plain = grad(fun, (0, 1, 2))(*tensors)
    for policy in POLICIES:
        for g, p in zip(grad(fun, (0, 1, 2), checkpoint=policy)(*tensors), plain):
            assert torch.equal(g, p)


def test_fan_out_and_the_leaf_hook_under_checkpointing():
    x = np.linspace(0.1, 0.9, 6).reshape(2, 3)
    seen = []

    def fun(x):
        total = ops.sum(x * 0.0)
        for k in range(30):
            total = total + ops.sum(ops.tanh(x * (k + 1)))
        return total

    expected = grad(fun)(x)
    got = grad(fun, checkpoint=3, on_leaf_grad=lambda index, g: seen.append((index, g.copy())))(x)
    np.testing.assert_array_equal(got, expected)
    assert len(seen) == 1 and seen[0][0] == 0
    np.testing.assert_array_equal(seen[0][1], expected)


# shape: (plain peak_total_bytes, "sqrt" peak_total_bytes, "sqrt" saved_bytes_peak, recomputed nodes), 81 steps of
# 8 x 8 float64 blocks (512 bytes; outputs_summed adds 8-byte sums). Deterministic: the tape's own counters.
STEPS = 81
SQRT_ON_SHAPES = {
    "chain": (42496, 8704, 7680, 67),
    "residual": (84480, 12288, 11264, 282),
    "fan_out": (167936, 16896, 15872, 513),
    "skip4": (83968, 22528, 20992, 244),
    "skip16": (83968, 37888, 36352, 190),
    "shared_weight": (84480, 12800, 12288, 223),
    "outputs_summed": (43528, 9320, 7880, 134),
    "dense": (124928, 19968, 19456, 339),
    "two_streams": (167936, 23040, 22528, 450),
    "unet": (63488, 43520, 29696, 108),
}


@pytest.mark.parametrize("shape", sorted(SQRT_ON_SHAPES))
def test_sqrt_segments_on_graph_shapes(shape):
    """√n segments on fan-out, skips over 4 and 16 steps, a weight read by every step, ...: the plain gradients
    bit for bit, each operation recomputed at most once (at most one extra forward pass), and the exact peaks,
    at most half the plain peak but on the U-Net-like shape, whose floor is higher (the next test); torch
    tensors count the same bytes."""
    x, z = graph_shapes.make_data(8)
    loss = graph_shapes.shape_loss(shape, STEPS)
    plain = value_and_grad(loss, (0, 1))
    expected_value, expected = plain(x, z)
    for mode in ACCUMULATE_MODES:
        df = value_and_grad(loss, (0, 1), accumulate=mode, checkpoint="sqrt")
        value, got = df(x, z)
        assert value == expected_value
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)
        assert df.stats.saved_bytes == 0 and df.stats.live_bytes == 0
    df = grad(loss, (0, 1), checkpoint="sqrt")
    df(x, z)
    stats = df.stats
    figures = (plain.stats.peak_total_bytes, stats.peak_total_bytes, stats.saved_bytes_peak, stats.recomputed_nodes)
    assert figures == SQRT_ON_SHAPES[shape]
    assert stats.recomputed_nodes <= plain.stats.nodes_run
    assert stats.peak_total_bytes <= 0.5 * plain.stats.peak_total_bytes or shape == "unet"
    on_torch = grad(loss, (0, 1), checkpoint="sqrt")
    on_torch(torch.tensor(x), torch.tensor(z))
    assert (on_torch.stats.peak_total_bytes, on_torch.stats.recomputed_nodes) == figures[1::2]


def test_the_unet_floor_holds_part_by_part_and_sqrt_comes_within_4_percent_of_it():
    """`unet_floor`: when the backward pass reaches the encoder, the checkpointed tape holds the plain engine's
    gradients and at least its saved values, the 40 encoder states; that total is 0.66 of the plain peak."""
    x, z = graph_shapes.make_data(8)
    loss = graph_shapes.shape_loss("unet", STEPS)
    plain, checkpointed = grad(loss, (0, 1)), grad(loss, (0, 1), checkpoint="sqrt")
    plain(x, z)
    checkpointed(x, z)
    turn = 3 * (STEPS - STEPS // 2)  # the last decoder operation
    assert checkpointed.stats.live_bytes_after_node == plain.stats.live_bytes_after_node
    assert plain.stats.saved_bytes_after_node[turn] == (STEPS // 2) * 512
    assert checkpointed.stats.saved_bytes_after_node[turn] >= plain.stats.saved_bytes_after_node[turn]
    floor, plain_peak = graph_shapes.unet_floor(D=8, steps=STEPS)
    assert (floor, plain_peak) == (41984, plain.stats.peak_total_bytes)  # 82 blocks of 124
    assert floor <= checkpointed.stats.peak_total_bytes <= 1.04 * floor
