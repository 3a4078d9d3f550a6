"""The instrument's own cost: every isolated trial's phases as records, summed by phase."""

import pytest

from benchlib.analysis.harness import phase_table
from benchlib.records import make_record, records_frame
from benchlib.records.metrics import HARNESS_PHASES, MetricError, harness_metric


def _rows(engine, **seconds):
    return [make_record(benchmark="b", case="c", engine=engine, device="cpu", dtype="float32",
                        metric=harness_metric(phase), value=value, params={"trial": trial})
            for trial in (0, 1) for phase, value in seconds.items()]


def test_every_phase_has_a_metric_and_an_unknown_phase_is_refused():
    assert [harness_metric(phase) for phase in HARNESS_PHASES][:2] == ["harness_process_time", "harness_setup_time"]
    with pytest.raises(MetricError, match="unknown harness phase 'imports'; the phases are process, setup"):
        harness_metric("imports")


def test_phase_table_sums_seconds_by_phase_in_phase_order_with_shares():
    records = records_frame(_rows("torch", timed=1.0, process=3.0) + _rows("autograd", timed=2.0, setup=2.0)
                            + [make_record(benchmark="b", case="c", engine="torch", device="cpu", dtype="float32",
                                           metric="time", value=9.0)])
    table = phase_table(records)
    assert table["phase"].tolist() == ["process", "setup", "timed"]
    assert table["seconds"].tolist() == [6.0, 4.0, 6.0] and table["trials"].tolist() == [2, 2, 4]
    assert table["share"].sum() == pytest.approx(1.0) and table["share"].iloc[0] == pytest.approx(6 / 16)
    by_engine = phase_table(records, by=("variant",))
    torch_rows = by_engine[by_engine["variant"] == "torch"]
    assert torch_rows["phase"].tolist() == ["process", "timed"]
    assert torch_rows["share"].tolist() == pytest.approx([0.75, 0.25])


def test_phase_table_of_records_without_phases_is_empty():
    records = records_frame([make_record(benchmark="b", case="c", engine="torch", device="cpu", dtype="float32",
                                         metric="time", value=1.0)])
    assert phase_table(records).empty


def test_the_run_summary_and_the_report_say_where_the_trials_time_went():
    from benchlib.report.tables.harness import harness_line, harness_section

    records = records_frame(_rows("torch", timed=1.0, process=3.0, allocation_pass=4.0))
    assert harness_line(records) == ("instrument: 2 isolated trial(s) took 16.00 s: allocation pass 50%, process 38%, "
                                     "timed 12% (timed: the calls the figures are made of)")
    section = harness_section(records)
    assert "Where the trials' time went" in section and "<td>allocation pass</td>" in section
    assert harness_line(records_frame([])) == harness_section(records_frame([])) == ""
