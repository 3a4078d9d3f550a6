"""Memory by role: exact tape roles for benchlib's engines, saved tensors for torch's, nothing for
engines that expose neither; and the stacked figure's 'other' is the measured peak minus both."""

import numpy as np
import pandas as pd
import pytest

from benchlib.engines import get_engine
from benchlib.engine_names import TORCH_AUTOGRAD
from benchlib.engines.roles import GRADIENT_METRIC, SAVED_METRIC, SavedTensors, role_gauge, tape_roles
from benchlib.measure import resolve_device
from benchlib.records import make_record
from benchlib.report.plots.gradients import peak_by_role, role_frame, role_timelines
from benchlib.workloads import dot_chain

D, DEPTH = 4, 9
BLOCK = D * D * 8  # one float64 D x D value


def _roles(engine_name):
    engine, device = get_engine(engine_name), resolve_device("cpu")
    x_np, z_np, _ = dot_chain.make_data(D, "float64", 0)
    x, z = engine.asarray(x_np, device), engine.asarray(z_np, device)
    xp = engine.namespace(device)
    gradient = engine.gradient(dot_chain.chain_loss(xp, DEPTH), 0, manual=dot_chain.manual_gradient(xp, DEPTH))
    gradient(x, z)
    if engine_name not in TORCH_AUTOGRAD:
        return tape_roles(gradient), gradient
    saved = SavedTensors(inputs=(x, z))  # what the role timeline's call reads in an isolated case
    with saved:
        gradient(x, z)
    return saved.metrics(), gradient


def test_benchlib_roles_are_the_two_parts_of_the_tapes_peak():
    inplace, gradient = _roles("benchlib-inplace")
    # the d-1 outputs z_1..z_(d-1) saved, and 3 gradient blocks (passed back, x's and z's contributions)
    assert inplace == {SAVED_METRIC: (DEPTH - 1) * BLOCK, GRADIENT_METRIC: 3 * BLOCK}
    assert inplace[SAVED_METRIC] + inplace[GRADIENT_METRIC] == gradient.stats.peak_total_bytes
    deferred, _ = _roles("benchlib-deferred")  # every contribution kept: its peak is all gradients
    assert deferred[SAVED_METRIC] == 0 and deferred[GRADIENT_METRIC] > 2 * (DEPTH - 1) * BLOCK
    checkpointed, _ = _roles("benchlib-checkpoint")
    assert checkpointed[SAVED_METRIC] < inplace[SAVED_METRIC]


@pytest.mark.parametrize("engine", ["manual", "autograd"])
def test_engines_that_expose_no_roles_report_none(engine):
    assert _roles(engine)[0] == {}


def test_torch_saved_tensors_are_counted_once_per_storage_without_the_inputs():
    pytest.importorskip("torch")
    torch_roles, _ = _roles("torch")
    assert torch_roles == {SAVED_METRIC: (DEPTH - 1) * BLOCK}  # the same outputs benchlib's tape saves
    checkpointed, _ = _roles("torch-checkpoint")
    assert 0 < checkpointed[SAVED_METRIC] < torch_roles[SAVED_METRIC]


def _gauge_at_end_of_forward(engine_name):
    """The engine's role gauge read inside the loss, once the forward pass has recorded every product."""
    engine, device = get_engine(engine_name), resolve_device("cpu")
    x_np, z_np, _ = dot_chain.make_data(D, "float64", 0)
    x, z = engine.asarray(x_np, device), engine.asarray(z_np, device)
    xp = engine.namespace(device)
    chain, seen = dot_chain.chain_loss(xp, DEPTH), []
    gauge = None

    def loss(x, z):
        out = chain(x, z)
        seen.append(gauge())
        return out

    gradient = engine.gradient(loss, 0, manual=None)
    gauge_factory = role_gauge(engine, gradient, inputs=(x, z))
    with gauge_factory() as gauge:
        gradient(x, z)
        after = gauge()
    return seen[0], after


@pytest.mark.parametrize("engine", ["benchlib-inplace", "torch"])
def test_role_gauges_read_what_is_saved_while_the_call_runs_and_nothing_after_it(engine):
    pytest.importorskip("torch")
    during, after = _gauge_at_end_of_forward(engine)
    # every product's output but the last is saved (z_1..z_(d-1)), the inputs are the caller's
    assert during["saved"] == (DEPTH - 1) * BLOCK
    assert during.get("gradients", 0) == 0  # the backward pass has not begun
    assert after["saved"] == 0 and after.get("gradients", 0) == 0


@pytest.mark.parametrize("engine, passive", [("benchlib-inplace", True), ("benchlib-checkpoint", True), ("torch", False),
                                             ("torch-checkpoint", False)])
def test_only_a_gauge_that_reads_what_the_engine_keeps_anyway_is_passive_enough_for_a_measured_call(engine, passive):
    # a passive gauge is read during a measured call (case_child.folded_roles); torch's hooks run in every save
    pytest.importorskip("torch")
    chosen = get_engine(engine)
    xp = chosen.namespace("cpu")
    gradient = chosen.gradient(dot_chain.chain_loss(xp, 3), 0)
    assert role_gauge(chosen, gradient)().passive is passive


def test_engines_that_expose_no_roles_have_no_gauge():
    engine = get_engine("manual")
    assert role_gauge(engine, lambda x: x) is None


def test_saved_tensors_uncounts_each_storage_when_autograd_releases_it():
    torch = pytest.importorskip("torch")
    x = torch.ones(10, 10, dtype=torch.float64, requires_grad=True)
    saved = SavedTensors(inputs=(x,))
    with saved as gauge:
        y = x * 2
        h = y.sin()  # saves y
        h2 = y.cos()  # saves y again: one storage, counted once
        assert gauge() == {"saved": 800}
        (h.sum() + h2.sum()).backward()
        assert gauge() == {"saved": 0}
    assert saved.peak_bytes == 800


def test_role_timelines_draw_one_panel_per_engine_in_the_given_order_with_the_allocator_over_the_stack():
    def samples(engine, gradients):
        return pd.DataFrame({"case": "c", "engine": engine, "device": "cpu", "t_s": [0.0, 0.1, 0.2],
                             "bytes": [0, 900, 0], "phase": "", "saved": [0, 600, 0], "gradients": gradients})
    frame = pd.concat([samples("torch", [np.nan] * 3), samples("benchlib-inplace", [0, 200, 0])])
    figure = role_timelines(frame, order=["manual", "benchlib-inplace", "torch"])
    assert [a.text for a in figure.layout.annotations][:2] == ["benchlib-inplace", "torch"]
    names = [(trace.name, trace.yaxis) for trace in figure.data]
    assert names == [("forward values saved for backward", "y"), ("gradient buffers", "y"),
                     ("process RSS above baseline", "y"), ("forward values saved for backward", "y2"),
                     ("process RSS above baseline", "y2")]
    assert [trace.showlegend for trace in figure.data] == [True, True, True, False, False]
    empty = role_timelines(frame.iloc[:0])  # only engines without roles ran: a figure that says so
    assert not empty.data and "no engine that exposes roles ran" in empty.layout.annotations[0].text


def test_role_frame_stacks_to_the_measured_peak_and_never_below_zero():
    def rows(engine, **values):
        return [make_record(benchmark="dot_chain", case="c", engine=engine, device="cpu", dtype="float64",
                            metric=metric, value=value, unit="B", params={"trial": 0})
                for metric, value in values.items()]
    records = pd.DataFrame(rows("benchlib-inplace", peak_bytes=1000.0, role_saved_bytes=600.0, role_gradient_bytes=300.0)
                           + rows("torch", peak_bytes=1000.0, role_saved_bytes=1200.0)
                           + rows("manual", peak_bytes=900.0))
    table = role_frame(records).set_index("engine")
    assert table.loc["benchlib-inplace", ["saved", "gradients", "other"]].tolist() == [600.0, 300.0, 100.0]
    assert table.loc["torch", "other"] == 0.0 and table.loc["manual", "other"] == 900.0
    assert table["source"].tolist() == ["exact, from the tape at its peak", "saved tensors packed by autograd (hooks)",
                                        "none exposed"]
    figure = peak_by_role(records)
    names = [trace.name for trace in figure.data]
    assert names[:3] == ["forward values saved for backward", "gradient buffers", "other: temporaries, allocator, unexposed"]
    assert names[3] == "measured peak" and list(figure.data[3].x) == ["torch"]  # roles above the peak are marked
    np.testing.assert_allclose(figure.data[2].y, [100 / 1e6, 0.0, 900 / 1e6])
