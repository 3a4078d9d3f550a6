"""Shared plot helpers: stable engine colours and ratios measured within one frame."""

import math

import pytest

from benchlib.records import make_record, records_frame
from benchlib import registry
from benchlib.benchmark import Benchmark, DeclarationError
from benchlib.report.palette import PALETTE, SERIES_COLORS, known_colors
from benchlib.report.plots.common import engine_color, log_ticks, ratio_frame


def rows(engine, case, values, metric="peak_bytes"):
    return [
        make_record(benchmark="b", case=case, engine=engine, device="cpu", dtype="float64",
                    metric=metric, value=value, repeat=repeat)
        for repeat, value in enumerate(values)
    ]


def test_engine_colours_are_fixed_for_known_engines_and_stable_for_others():
    registry.benchmarks()  # every declaration's own colours registered
    for group, colors in SERIES_COLORS.items():  # names drawn together never share a colour
        assert len(set(colors.values())) == len(colors), group
    assert not set(known_colors().values()) & set(PALETTE)  # a hashed name never looks like a fixed one
    assert engine_color("torch") == SERIES_COLORS["engines"]["torch"]
    assert engine_color("naive") == SERIES_COLORS["mnist_ensembles"]["naive"]  # declared with its benchmark
    assert engine_color("jax") in PALETTE and engine_color("jax") == engine_color("jax")


def test_a_benchmark_declares_its_own_series_colours_and_cannot_recolour_another_s():
    declared = Benchmark(name="colour_probe", question="?", parameters=(), measure=lambda config, device: [],
                         colors={"probe-series": "#010203"})
    assert engine_color("probe-series") != "#010203"  # declaring registers nothing
    declared.register()
    assert engine_color("probe-series") == "#010203" and declared.colors["probe-series"] == "#010203"
    with pytest.raises(DeclarationError, match="'torch' is already drawn in"):
        Benchmark(name="colour_thief", question="?", parameters=(), measure=lambda config, device: [],
                  colors={"torch": "#010204"}).register()
    SERIES_COLORS.pop("colour_probe")


def test_ratio_frame_divides_medians_by_the_baseline_in_each_case():
    frame = records_frame(
        rows("manual", "small", [2, 4, 6]) + rows("torch", "small", [8, 9, 7])
        + rows("manual", "large", [10]) + rows("torch", "large", [25]) + rows("torch", "large", [1], metric="time")
    )
    ratios = ratio_frame(frame, metric="peak_bytes", baseline="manual").set_index(["case", "variant"])["ratio"]
    assert ratios[("small", "torch")] == 2.0 and ratios[("large", "torch")] == 2.5
    assert ratios[("small", "manual")] == 1.0
    with pytest.raises(ValueError, match=r"engines present: \['manual', 'torch'\]"):
        ratio_frame(frame, metric="peak_bytes", baseline="autograd")


def test_ratio_is_nan_where_the_baseline_was_not_measured():
    frame = records_frame(rows("manual", "small", [2]) + rows("torch", "small", [4]) + rows("torch", "cuda-only", [4]))
    ratios = ratio_frame(frame, metric="peak_bytes", baseline="manual").set_index(["case", "variant"])["ratio"]
    assert math.isnan(ratios[("cuda-only", "torch")])


def test_log_ticks_are_a_labelled_1_2_5_series_spanning_the_values():
    assert log_ticks(2, 250) == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
    assert log_ticks(0.03, 0.04) == [0.02, 0.05]
    with pytest.raises(ValueError, match="0 < low <= high"):
        log_ticks(0, 1)
