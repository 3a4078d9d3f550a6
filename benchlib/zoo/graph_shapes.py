"""Graph shapes beyond the chain, for checkpointing: what √n snapshots and a budget save on each.

Every shape is `steps` steps over D x D blocks, a loss of `(x, z)` written with
`benchlib.autodiff.ops`: skip connections, fan-out, a computed weight read by every step, several
outputs summed, an encoder whose states a mirrored decoder reads again (U-Net-like; `unet_floor`
is the least peak segment checkpointing can give it). `shape_table` runs each under benchlib's
engine, plain and checkpointed, and reports the tape's exact counters (deterministic, so one
in-process run is the figure) and the largest relative difference from the plain gradient. `case`
is the fresh-process target (`benchlib.measure.run_isolated`), for the peak the process itself sees.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from benchlib import autodiff
from benchlib.autodiff import ops
from benchlib.measure import Case

TARGET = "benchlib.zoo.graph_shapes:case"


def _chain(x, z, steps):
    for _ in range(steps):
        z = x @ z
    return ops.sum(z)


def _residual(x, z, steps):
    for _ in range(steps):
        z = ops.tanh(x @ z) + 0.5 * z
    return ops.sum(z)


def _fan_out(x, z, steps):
    for _ in range(steps):
        z = ops.tanh(x @ z) + ops.tanh(z) * ops.tanh(z @ x)  # z read by three operations
    return ops.sum(z)


def _skip(span):
    def loss(x, z, steps):
        history = [z] * span  # z_(k-span) .. z_(k-1)
        for _ in range(steps):
            z = ops.tanh(x @ z) + 0.5 * history[0]  # a skip over `span` steps
            history = [*history[1:], z]
        return ops.sum(z)

    return loss


def _shared_weight(x, z, steps):
    w = ops.tanh(x)  # computed once, read by every step
    for _ in range(steps):
        z = ops.tanh(w @ z) * w
    return ops.sum(z)


def _outputs_summed(x, z, steps):
    total = 0.0
    for _ in range(steps):
        z = ops.tanh(x @ z)
        total = total + ops.sum(z * z)  # each step's output also feeds the loss
    return total


def _dense(x, z, steps):
    previous = [z, z]
    for _ in range(steps):
        z = ops.tanh(x @ (previous[-1] + previous[-2])) + 0.5 * z  # reads the last three states
        previous = [previous[-1], z]
    return ops.sum(z)


def _two_streams(x, z, steps):
    a, b = z, ops.tanh(z)
    for _ in range(steps):
        a, b = ops.tanh(x @ b) + a, ops.tanh(a @ x) * b  # two states, each step mixes both
    return ops.sum(a * b)


def _unet(x, z, steps):
    half = steps // 2
    encoder = [z]  # e_0 .. e_half
    for _ in range(half):
        encoder.append(ops.tanh(x @ encoder[-1]))
    d = encoder[half]
    for k in range(steps - half):
        d = ops.tanh(x @ d) + encoder[half - k]  # decoder step k reads encoder state half - k
    return ops.sum(d)


SHAPES = {
    "chain": (_chain, "z = x @ z"),
    "residual": (_residual, "z = tanh(x @ z) + 0.5 z"),
    "fan_out": (_fan_out, "z = tanh(x @ z) + tanh(z) * tanh(z @ x)"),
    "skip4": (_skip(4), "z_k = tanh(x @ z_(k-1)) + 0.5 z_(k-4)"),
    "skip16": (_skip(16), "z_k = tanh(x @ z_(k-1)) + 0.5 z_(k-16)"),
    "shared_weight": (_shared_weight, "w = tanh(x); z = tanh(w @ z) * w"),
    "outputs_summed": (_outputs_summed, "z = tanh(x @ z); loss += sum(z * z)"),
    "dense": (_dense, "z_k = tanh(x @ (z_(k-1) + z_(k-2))) + 0.5 z_(k-1)"),
    "two_streams": (_two_streams, "a, b = tanh(x @ b) + a, tanh(a @ x) * b"),
    "unet": (_unet, "e_k = tanh(x @ e_(k-1)), n/2 steps; d_k = tanh(x @ d_(k-1)) + e_(n/2-k)"),
}


def shape_loss(shape: str, steps: int):
    """The loss `(x, z) -> scalar` of `shape` with `steps` steps."""
    return lambda x, z: SHAPES[shape][0](x, z, steps)


def make_data(D: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """x orthogonal, so that a product of many x neither blows up nor vanishes; z standard normal (float64)."""
    rng = np.random.default_rng(seed)
    return np.linalg.qr(rng.standard_normal((D, D)))[0], rng.standard_normal((D, D))


def shape_table(shapes=tuple(SHAPES), *, D: int = 32, steps: int = 81, policies=("sqrt", 6)) -> pd.DataFrame:
    """One row per shape and policy: the tape's peaks (plain and checkpointed), their ratio, the
    operations recomputed per operation on the tape, and the gradient's largest relative error."""
    x, z = make_data(D)
    rows = []
    for shape in shapes:
        plain = autodiff.grad(shape_loss(shape, steps), (0, 1))
        expected = plain(x, z)
        tape = plain.stats.nodes_run
        for policy in policies:
            checkpointed = autodiff.grad(shape_loss(shape, steps), (0, 1), checkpoint=policy)
            got = checkpointed(x, z)
            error = max(float(np.max(np.abs(g - e)) / np.max(np.abs(e))) for g, e in zip(got, expected))
            stats = checkpointed.stats
            rows.append({"shape": shape, "step": SHAPES[shape][1], "policy": str(policy), "operations": tape,
                         "plain_peak_bytes": plain.stats.peak_total_bytes, "peak_bytes": stats.peak_total_bytes,
                         "peak_ratio": stats.peak_total_bytes / plain.stats.peak_total_bytes,
                         "recomputed_nodes": stats.recomputed_nodes,
                         "recompute_factor": stats.recomputed_nodes / tape, "grad_max_rel_err": error})
    return pd.DataFrame(rows)


def unet_floor(*, D: int = 32, steps: int = 81) -> tuple[int, int]:
    """(the least peak any "sqrt" boundaries can give the U-Net-like shape, its plain peak), in bytes.

    Take the moment the backward pass has run the decoder (its 3·(steps - steps//2) operations and the
    sum) and reaches the encoder. Every encoder state e_j, j >= 1, is held then, whatever the
    boundaries: if one lies between e_j and the decoder step that reads it, e_j crosses it and is held
    from the forward pass until its own tanh's VJP has run; if none does, the segment of that decoder
    step reaches back past e_j and was recomputed before that moment (the step's tanh VJP read its
    output), keeping e_j for its tanh's VJP. The gradients held then are those of the plain engine
    (the same order, the same accumulation), which holds exactly these states and gradients then:
    its total at that moment is the floor (the tests check each part on the checkpointed tape)."""
    x, z = make_data(D)
    plain = autodiff.grad(shape_loss("unet", steps), (0, 1))
    plain(x, z)
    stats, turn = plain.stats, 3 * (steps - steps // 2)  # index of the last decoder operation run
    return stats.live_bytes_after_node[turn] + stats.saved_bytes_after_node[turn], stats.peak_total_bytes


def case(*, device, shape: str, D: int, steps: int, checkpoint=None) -> Case:
    """The gradient of `shape` under `checkpoint` (None: plain), for a fresh process to measure."""
    x, z = make_data(D)
    gradient = autodiff.grad(shape_loss(shape, steps), (0, 1), checkpoint=checkpoint)
    return Case(lambda: gradient(x, z), lambda result: {"peak_total_bytes": gradient.stats.peak_total_bytes,
                                                        "recomputed_nodes": gradient.stats.recomputed_nodes})
