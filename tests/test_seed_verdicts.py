"""Seed verdict rules on small synthetic record frames with known answers."""

import math

import numpy as np
import pytest
import pandas as pd

from benchlib.registry import verdict_rules
from benchlib.records import make_record
from benchlib.analysis.seed_verdicts import (
    INCONCLUSIVE,
    REFUTED,
    REPRODUCED,
    seed_verdicts,
    verdict_of,
    verdict_text,
)


def judge(records):
    """The verdicts of every declared benchmark's rules on `records`."""
    return seed_verdicts(records, verdict_rules())


def _dot_chain(peaks, repeats=8):
    jitter = np.linspace(0.99, 1.01, repeats)
    return pd.DataFrame([
        make_record(benchmark="dot_chain", case="D=10,depth=5", engine=engine, device="cpu", dtype="float64",
                    metric="peak_bytes", value=peak * factor, unit="B", repeat=repeat)
        for engine, peak in peaks.items() for repeat, factor in enumerate(jitter)])


def test_deferred_at_twice_and_inplace_at_the_floor_are_reproduced():
    table = judge(_dot_chain({"manual": 1000, "benchlib-deferred": 2000, "benchlib-inplace": 1000}))
    assert table["verdict"].tolist() == [REPRODUCED, REPRODUCED]
    assert table["baseline"].tolist() == ["manual", "manual"]
    assert math.isclose(table["ratio"][0], 2.0)


def test_deferred_at_the_floor_refutes_the_2x_claim():
    table = judge(_dot_chain({"manual": 1000, "benchlib-deferred": 1000, "benchlib-inplace": 1000}))
    assert table["verdict"].tolist() == [REFUTED, REPRODUCED]


def test_one_trial_a_side_is_inconclusive_and_missing_engines_give_no_row():
    table = judge(_dot_chain({"manual": 1000, "benchlib-deferred": 2000}, repeats=1))
    assert table["verdict"].tolist() == [INCONCLUSIVE]
    assert judge(_dot_chain({"manual": 1000})).empty


def test_an_interval_straddling_the_range_edge_is_inconclusive():
    assert verdict_of(1.4, 1.8, 1.5, 2.5) == INCONCLUSIVE
    assert verdict_of(1.6, 1.8, 1.5, 2.5) == REPRODUCED
    assert verdict_of(0.9, 1.2, 1.5, 2.5) == REFUTED


def test_the_printed_table_names_verdict_ratio_and_claim():
    text = verdict_text(judge(_dot_chain({"manual": 1000, "benchlib-deferred": 2000, "benchlib-inplace": 1000})))
    assert "reproduced" in text and "2 [" in text and "deferred accumulation" in text
    assert verdict_text(judge(_dot_chain({"manual": 1000}))).startswith("seed verdicts: none")
    quick = verdict_text(judge(_dot_chain({"manual": 1000, "benchlib-deferred": 2000})), quick=True).splitlines()
    assert quick[1].startswith("  (quick sizes:") and "deferred accumulation" in quick[2]


def test_ensemble_rules_read_throughput_up_and_peak_down():
    def rows(engine, metric, value, unit):
        return [make_record(benchmark="mnist_ensembles", case=f"{engine}|gc=default", engine=engine, device="cpu",
                            dtype="float32", metric=metric, value=value * f, unit=unit, repeat=i,
                            params={"gc_policy": "default", "heap_objects": 0, "trial": i})
                for i, f in enumerate(np.linspace(0.98, 1.02, 6))]
    records = pd.DataFrame(rows("naive", "throughput", 1e5, "model-samples/s")
                           + rows("batched_hand", "throughput", 1.5e5, "model-samples/s")
                           + rows("naive", "peak_bytes", 16e6, "B") + rows("step_in_backward", "peak_bytes", 9e6, "B"))
    table = judge(records).set_index("baseline")
    assert table["verdict"].tolist() == [REFUTED, REPRODUCED]  # 1.5x is short of the claimed 2x gain


def test_grid_points_are_judged_apart_never_pooled():
    from benchlib.records import make_record, records_frame

    rows = []
    for size, deferred in ((10, 2000.0), (20, 8000.0)):
        for engine, value in (("manual", 1000.0 * size / 10), ("benchlib-deferred", deferred)):
            for repeat in range(3):
                rows.append(make_record(benchmark="dot_chain", case=f"D={size}", engine=engine, device="cpu",
                                        dtype="float64", metric="peak_bytes", value=value + repeat, unit="B",
                                        repeat=repeat, params={"grid": {"D": size}}))
    table = judge(records_frame(rows)).set_index("grid_point")
    assert table.loc["D=10", "ratio"] == pytest.approx(2.0, rel=1e-3)
    assert table.loc["D=20", "ratio"] == pytest.approx(4.0, rel=1e-3)


def _rnn(growth_in_w, trials=3, hidden=4):
    weight = hidden * hidden * 4
    return pd.DataFrame([
        make_record(benchmark="rnn_fanout", case=f"T={T}", engine=engine, device="cpu", dtype="float32",
                    metric="peak_bytes", value=1000 + growth * weight * T + trial, unit="B",
                    params={"T": T, "hidden": hidden, "trial": trial})
        for engine, growth in growth_in_w.items() for T in (2, 4, 8) for trial in range(trials)])


def test_rnn_growth_is_judged_by_the_slope_per_trial_in_weight_sized_buffers():
    table = judge(_rnn({"benchlib-deferred": 1.0, "benchlib-inplace": 0.0}))
    assert table["verdict"].tolist() == [REPRODUCED, REPRODUCED]
    assert table["ratio"].tolist() == pytest.approx([1.0, 0.0], abs=1e-9)
    assert judge(_rnn({"benchlib-deferred": 0.0}))["verdict"].tolist() == [REFUTED]
    assert judge(_rnn({"benchlib-deferred": 1.0}, trials=1))["verdict"].tolist() == [INCONCLUSIVE]


def test_closure_rules_compare_two_cases_of_one_engine_per_mwe_and_order():
    def rows(step, counts):
        return [make_record(benchmark="identical_closures", case=f"{mwe}/seed/{step}", engine="torch", device="cpu",
                            dtype="float32", metric="warm_alloc_count", value=count, unit="count", repeat=i,
                            params={"mwe": mwe, "order": "seed", "step": step})
                for mwe, count_of in (("dense", counts), ("reduced", counts)) for i, count in enumerate(count_of)]
    same = judge(pd.DataFrame(rows("initial", [419, 419]) + rows("structurally identical new", [419, 419])))
    assert same["verdict"].tolist() == [REPRODUCED, REPRODUCED]
    assert same["group"].tolist() == ["mwe=dense, order=seed", "mwe=reduced, order=seed"]
    fewer = judge(pd.DataFrame(rows("initial", [419, 419]) + rows("structurally identical new", [329, 329])))
    assert fewer["verdict"].tolist() == [REFUTED, REFUTED]  # the seed's Zygote numbers: 419 then 329


def test_a_derived_ratio_metric_is_taken_per_trial_before_the_rule_compares():
    def rows(strategy, median, p99):
        return [make_record(benchmark="mnist_ensembles", case=f"{strategy}|gc=default", strategy=strategy, device="cpu",
                            dtype="float32", metric=metric, value=value * (1 + 0.01 * trial), unit="s",
                            params={"gc_policy": "default", "heap_objects": 0, "trial": trial})
                for trial in range(4) for metric, value in (("step_time_median", median), ("step_time_p99", p99))]
    table = judge(pd.DataFrame(rows("naive", 0.1, 0.3) + rows("batched_hand", 0.01, 0.011)))
    assert table["verdict"].tolist() == [REPRODUCED]
    assert table["ratio"].iloc[0] == pytest.approx(1.1 / 3)


def test_the_manual_gc_rule_finds_its_cases_by_their_gc_policy_param():
    def rows(policy, value):
        return [make_record(benchmark="mnist_ensembles", case=f"naive|gc={policy}|heap=0|threads=2", engine="naive",
                            device="cpu", dtype="float32", metric="throughput", value=value * f, unit="model-samples/s",
                            params={"gc_policy": policy, "heap_objects": 0, "trial": i})
                for i, f in enumerate(np.linspace(0.98, 1.02, 6))]
    table = judge(pd.DataFrame(rows("default", 1e5) + rows("manual", 0.8e5)))
    (row,) = table[table["claim"].str.contains("manual GC")].itertuples()
    assert row.verdict == REPRODUCED and row.ratio == pytest.approx(0.8, rel=0.01) and row.group == "heap_objects=0"
