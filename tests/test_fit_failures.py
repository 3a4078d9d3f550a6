"""A step that fails at some value (the user's code raised, its process was killed or timed out) bounds every answer
below it: no answer is extrapolated past a failure or given at a value whose check failed, the line says where and
why, and the records keep the failure as `failed`, never `not_applicable`."""

import json

from benchlib.fit import fit, measured
from benchlib.fit.measured import StepOutcome
from test_fit import MB, NO_VERIFY, VERIFY, model_file

KILLED = "failed: the child process was killed by SIGKILL (often the kernel's out-of-memory killer) before writing a result"


def _measure(fails_from: int, why: str = "failed: the child raised ValueError: batch too large"):
    asked = []

    def measure(_file, engine, values, _device, **_options):
        asked.append(values["n"])
        if values["n"] >= fails_from:
            return StepOutcome(reason=why)
        return StepOutcome(int(100 * MB + values["n"] * MB / 4), values["n"] * 1e-3)
    return measure, asked


def test_an_answer_is_never_extrapolated_past_a_value_whose_step_failed(fit_children_here, tmp_path, monkeypatch):
    measure, asked = _measure(fails_from=100)  # the grid (8..64) holds; the next point toward the answer fails
    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=NO_VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert max(asked) >= 100 and torch_fit.failed  # it was asked past 100, and failed there
    assert torch_fit.largest == 64  # the largest measured value below the failure, not the 402 the line predicts
    lines = "\n".join(result.lines())
    assert "failed at n=" in lines and "batch too large" in lines
    failed = [row for row in result.records() if row["metric"] == "failed"]
    assert failed and all(json.loads(row["params"])["value"] >= 100 for row in failed)


def test_a_step_that_fails_past_its_first_value_is_recorded_failed_not_not_applicable(fit_children_here, tmp_path, monkeypatch):
    measure, _ = _measure(fails_from=16)
    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=NO_VERIFY, progress=lambda line: None)
    assert result.best is None
    metrics = {row["metric"] for row in result.records()}
    assert "failed" in metrics and "not_applicable" not in metrics


def test_verify_never_answers_a_value_whose_check_was_killed(fit_children_here, tmp_path, monkeypatch):
    from benchlib.measure import isolation

    checked = []

    def measure(_file, engine, values, _device, **_options):  # the grid holds; every confirming process is killed
        if values["n"] > 64:
            checked.append(values["n"])
            return StepOutcome(reason=KILLED)
        return StepOutcome(int(100 * MB + values["n"] * MB / 4), values["n"] * 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    monkeypatch.setattr(isolation, "available_memory", lambda device: 10 ** 12)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert checked and all(torch_fit.largest < value for value in checked)
    assert torch_fit.largest == 64
    assert "killed by SIGKILL" in "\n".join(result.lines())


def test_totals_that_do_not_grow_are_measured_farther_out_and_never_answer_any_value(fit_children_here, tmp_path, monkeypatch):
    from benchlib.fit.sizing import grows

    asked = []

    def flat(_file, engine, values, _device, **_options):  # noise around 100 MB, falling a little with the value
        asked.append(values["n"])
        return StepOutcome(int(100 * MB - values["n"] * 10 + (values["n"] % 3) * 200_000), 1e-3)

    monkeypatch.setattr(measured, "measure_step", flat)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=NO_VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert asked[:4] == [8, 16, 32, 64] and asked[4:8] == [512, 4096, 32768, 262144]  # 8x farther, four times
    assert not grows([(value, total) for value, total, _ in torch_fit.points])
    assert torch_fit.largest == 262144  # the largest value measured: nothing read from a slope of noise
    lines = "\n".join(result.lines())
    assert "any value" not in lines and "does not measurably grow from n=8 to 262144" in lines
    assert "its batch alone would take it to the limit at n=" in lines  # 16 bytes a sample: near 6.3 million


def test_flat_totals_over_the_limit_never_name_a_value_where_the_batch_would_reach_it(fit_children_here, tmp_path,
                                                                                     monkeypatch):
    def flat(_file, engine, values, _device, **_options):  # about 100 MB at every value, over a 50 MB limit
        return StepOutcome(int(100 * MB + values["n"] * 10 + (values["n"] % 3) * 200_000), 1e-3)

    monkeypatch.setattr(measured, "measure_step", flat)
    result = fit(model_file(tmp_path), memory="50 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=NO_VERIFY, progress=lambda line: None)
    lines = "\n".join(result.lines())
    assert "does not fit at the smallest n measured" in lines
    assert "would take it to the limit" not in lines  # it was a negative n: the limit lies below every total


def test_totals_that_grow_farther_out_are_fitted_from_there(fit_children_here, tmp_path, monkeypatch):
    def late(_file, engine, values, _device, **_options):  # flat to 64; 1 kB a sample shows from 512 on
        return StepOutcome(int(100 * MB + values["n"] * 1000), 1e-3)

    monkeypatch.setattr(measured, "measure_step", late)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=NO_VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert not torch_fit.flat and 512 in [value for value, _, _ in torch_fit.points]
    assert abs(torch_fit.largest - 100_600) <= 1  # the line through the points, now that it rises


def test_every_confirming_process_is_capped_just_past_the_limit(fit_children_here, tmp_path, monkeypatch):
    from benchlib.measure import isolation

    caps = {}

    def measure(_file, engine, values, _device, cap_bytes=None, **_options):
        caps[values["n"]] = cap_bytes
        total = int(100 * MB + values["n"] * MB / 4)
        if cap_bytes is not None and total > cap_bytes:  # the process ends itself past its cap
            return StepOutcome(cap_bytes + 1, float("nan"))
        return StepOutcome(total, values["n"] * 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    monkeypatch.setattr(isolation, "available_memory", lambda device: 10 ** 12)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=VERIFY, progress=lambda line: None)
    assert result.best.confirmed == 402
    confirming = {value: cap for value, cap in caps.items() if value not in (8, 16, 32, 64, 252)}
    assert confirming and set(confirming.values()) == {int(200.6 * MB * 1.05)}
    assert {caps[value] for value in (8, 16, 32, 64)} == {None}  # the user's own grid runs as asked


def test_an_answer_no_value_held_in_every_process_is_said_not_confirmed(fit_children_here, tmp_path, monkeypatch):
    """Totals that differ between fresh processes (the first under the limit, the next 30% higher): the hold gives
    up, and no single later process may call the answer confirmed."""
    processes = {}

    def measure(_file, _engine, values, _device, **_options):
        n = values["n"]
        processes[n] = processes.get(n, 0) + 1
        factor = 1.0 if n <= 64 else (0.9 if processes[n] == 1 else 1.3)
        return StepOutcome(int((100 * MB + n * MB) * factor), 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert torch_fit.confirmed is None and "no value held the limit in 3 processes" in torch_fit.unconfirmed
    lines = "\n".join(result.lines())
    assert "not confirmed: no value held the limit" in lines.splitlines()[0]
    assert "confirmed: measured" not in lines and "measured to confirm it" not in lines


def test_no_engine_fits_says_how_many_were_measured_and_how_many_could_not_be(fit_children_here, tmp_path,
                                                                               monkeypatch):
    def over(_file, engine, values, _device, **_options):  # torch over the limit; autocast's step never runs
        if engine != "torch":
            return StepOutcome(reason="not applicable: on purpose")
        return StepOutcome(int(100 * MB + values["n"] * MB), values["n"] * 1e-3)

    monkeypatch.setattr(measured, "measure_step", over)
    result = fit(model_file(tmp_path), memory="50 MB", scale="n", engines=["torch", "torch-autocast"],
                 params={"n": 16}, search=NO_VERIFY, progress=lambda line: None)
    (answer,) = result.answers()
    assert answer == ("tiny: the one engine measured does not fit 50.00 MB (the process's resident high-water mark) "
                      "even at the smallest n measured; 1 more could not be measured (each says why)")


def test_an_engine_whose_technique_check_raises_is_failed_and_never_measured(fit_children_here, tmp_path, monkeypatch):
    from test_techniques_compose import FAULTY

    asked = []

    def measure(_file, engine, values, _device, **_options):
        asked.append(engine)
        return StepOutcome(int(100 * MB + values["n"] * MB), values["n"] * 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    path = tmp_path / "faulty_model.py"
    path.write_text(FAULTY)
    result = fit(path, memory="1 GB", scale="n", engines=["torch", "faulty", "torch-autocast+refuses-badly"],
                 params={"n": 8}, search=NO_VERIFY, progress=lambda line: None)
    assert set(asked) == {"torch"}
    faulty = {each.engine: each for each in result.engines if each.engine != "torch"}
    assert faulty["faulty"].reason == "failed: technique faulty: its not_applicable raised KeyError: 'no such layer'"
    assert faulty["torch-autocast+refuses-badly"].reason.startswith("failed: technique refuses-badly: its refuses")
    statuses = {record["variant"]: json.loads(record["params"])["status"] for record in result.records()
                if record["metric"] == "failed" or "status" in json.loads(record["params"])}
    assert statuses["faulty"] == "failed"
