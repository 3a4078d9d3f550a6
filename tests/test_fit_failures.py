"""A step that fails at some value (the user's code raised, its process was killed or timed out) bounds every answer
below it: no answer is extrapolated past a failure or given at a value whose check failed, the line says where and
why, and the records keep the failure as `failed`, never `not_applicable`."""

import json

from benchlib.fit import fit, measured
from test_fit import MB, model_file

KILLED = "failed: the child process was killed by SIGKILL (often the kernel's out-of-memory killer) before writing a result"


def _measure(fails_from: int, why: str = "failed: the child raised ValueError: batch too large"):
    asked = []

    def measure(_file, engine, values, _device, **_options):
        asked.append(values["n"])
        if values["n"] >= fails_from:
            return why
        return int(100 * MB + values["n"] * MB / 4), values["n"] * 1e-3
    return measure, asked


def test_an_answer_is_never_extrapolated_past_a_value_whose_step_failed(tmp_path, monkeypatch):
    measure, asked = _measure(fails_from=100)  # the grid (8..64) holds; the next point toward the answer fails
    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 verify=False, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert max(asked) >= 100 and torch_fit.failed  # it was asked past 100, and failed there
    assert torch_fit.largest == 64  # the largest measured value below the failure, not the 402 the line predicts
    lines = "\n".join(result.lines())
    assert "failed at n=" in lines and "batch too large" in lines
    failed = [row for row in result.records() if row["metric"] == "failed"]
    assert failed and all(json.loads(row["params"])["value"] >= 100 for row in failed)


def test_a_step_that_fails_past_its_first_value_is_recorded_failed_not_not_applicable(tmp_path, monkeypatch):
    measure, _ = _measure(fails_from=16)
    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 verify=False, progress=lambda line: None)
    assert result.best is None
    metrics = {row["metric"] for row in result.records()}
    assert "failed" in metrics and "not_applicable" not in metrics


def test_verify_never_answers_a_value_whose_check_was_killed(tmp_path, monkeypatch):
    from benchlib.measure import isolation

    checked = []

    def measure(_file, engine, values, _device, **_options):  # the grid holds; every confirming process is killed
        if values["n"] > 64:
            checked.append(values["n"])
            return KILLED
        return int(100 * MB + values["n"] * MB / 4), values["n"] * 1e-3

    monkeypatch.setattr(measured, "measure_step", measure)
    monkeypatch.setattr(isolation, "available_memory", lambda device: 10 ** 12)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 verify=True, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert checked and all(torch_fit.largest < value for value in checked)
    assert torch_fit.largest == 64
    assert "killed by SIGKILL" in "\n".join(result.lines())
