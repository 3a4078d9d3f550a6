"""Gradient checkpointing: same gradients bit for bit, exact memory counters, Revolve's recomputation count."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchlib.autodiff import ACCUMULATE_MODES, grad, ops, value_and_grad
from benchlib.autodiff.checkpoint import SqrtSnapshots, revolve_cost, revolve_cost_closed_form

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
    def __init__(self, index):
        self.index = index


def kept_by_sqrt(n_nodes: int) -> set[int]:
    """The tape indices the "sqrt" schedule keeps after a forward pass of `n_nodes` operations."""
    schedule, kept = SqrtSnapshots(), {}
    ledger = SimpleNamespace(acquire=lambda value: None, release=lambda value: None)
    for index in range(n_nodes):
        schedule.offer(_Node(index), index, kept, ledger)
    return {node.index for node in kept}


def test_sqrt_keeps_about_root_n_evenly_spaced_snapshots():
    for n in (10, 101, 1000):
        kept = sorted(kept_by_sqrt(n))
        stride = kept[1] - kept[0]
        assert kept == list(range(0, n, stride))
        assert np.sqrt(n / 2) <= stride <= 2 * np.sqrt(n) and len(kept) <= 2 * stride


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
            if policy == "sqrt":  # its saved peak can fall in the forward pass, when no gradient is live
                needed = set(range(depth - 1))  # outputs of dots 0..d-2; the tape also holds the sum
                assert stats.recomputed_nodes == len(needed - kept_by_sqrt(depth + 1)), depth
                assert stats.saved_bytes_peak <= (len(kept_by_sqrt(depth + 1)) + 2) * block + 8
                assert stats.peak_total_bytes < plain.stats.peak_total_bytes or depth < 6
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
