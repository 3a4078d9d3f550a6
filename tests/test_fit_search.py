"""fit's one search loop (`benchlib.fit.search`) and a measured fit's plan of phases (`benchlib.fit.plan`)."""

import re
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st

from benchlib.fit import measured
from benchlib.fit.largest import fit
from benchlib.fit.measured import StepOutcome
from benchlib.fit.plan import plan
from benchlib.fit.search import SEARCH_LIMIT, Bracketing, Toward, drive, largest_under
from benchlib.fit.settings import THOROUGH
from benchlib.fit.sizing import SizeModel
from test_usermodel import GOOD

MB = 1e6


def rising(rises: list[int], power: int):
    """A nondecreasing total: steps (allocator segments), plateaus, and a power of the value (attention's square)."""
    return lambda value: (sum(rises[:value % len(rises)]) + (value // len(rises)) * sum(rises)
                          + value ** power // 10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=30), st.integers(1, 20), st.integers(0, 4000),
       st.sampled_from([0, 1, 2]), st.sampled_from([0.0, 0.02, 0.1]), st.sampled_from([1, 2, 4]),
       st.booleans())
def test_the_search_toward_the_limit_ends_where_a_value_by_value_walk_would(rises, start, limit, power, resolution,
                                                                            step, neighbour):
    """Any rising total, any bracketing: the answer is a multiple of the step under the limit, and the first value
    over lies within the resolution (or one step) above it; exact bracketings find the walk's own answer."""
    total = rising(rises, power)
    start = start * step
    known = {start: total(start)}
    answer = largest_under(total, limit, known, Bracketing(resolution=resolution, step=step, reach=8,
                                                           ceiling=4096, neighbour=neighbour))
    multiples = range(start, 4097, step)
    walked = None if total(start) > limit else next((value - step for value in multiples if total(value) > limit),
                                                    max(multiples))
    if walked is None or answer == max(multiples):
        assert answer == walked
        return
    assert answer % step == 0 and total(answer) <= limit
    first_over = next(value for value in multiples if value > answer and total(value) > limit)
    assert first_over - answer <= max(step, int(answer * resolution)) or answer == walked
    if resolution == 0 and step == 1:
        assert answer == walked


def test_a_probe_that_fails_stops_the_search_without_an_answer():
    known = {8: 100.0}
    toward = Toward(lambda: known, 1000.0, Bracketing())
    asked = []
    drive(toward, lambda value: asked.append(value) or False)
    assert len(asked) == 1 and toward.answer is None


def test_a_value_that_failed_bounds_the_answer_below_it():
    known = {8: 100.0, 16: 200.0}
    toward = Toward(lambda: known, 10_000.0, Bracketing(), over=lambda: [40])

    def probe(value):
        known[value] = value * 12.5
        return True

    drive(toward, probe)
    assert toward.answer == 39


def test_a_size_model_that_never_reaches_the_limit_fits_at_any_value():
    flat = SizeModel("linear", (0.0, 500.0), 0.0)
    assert flat.largest_under(1000, 2) == SEARCH_LIMIT and flat.largest_under(100, 2) is None
    assert SizeModel("linear", (10.0, 100.0), 0.0).largest_under(1100.5, 2) == 100


def test_the_plan_names_its_phases_in_order_and_only_those_the_question_asks_for():
    class Asked:
        added = []

    names = [phase.name for phase in plan(Asked(), verify=False)]
    assert names == ["the grid", "farther out, where the totals do not grow", "size models", "toward the answer"]
    Asked.added = ["torch-checkpoint+torch-autocast"]
    names = [phase.name for phase in plan(Asked(), verify=True)]
    assert names[4] == "the combinations, predicted from their traces" and names[5] == "the frontier, the grid"
    assert names[-3:] == ["confirming the largest", "each engine's own answer",
                          "the fastest, at the value every engine reaches"]


def test_the_progress_line_numbers_each_phase_against_the_plan(fit_children_here, tmp_path, monkeypatch):
    path = tmp_path / "tiny.py"
    path.write_text(textwrap.dedent(GOOD))

    def measure(_file, engine, values, _device, **_options):
        return StepOutcome(int(100 * MB + values["n"] * MB), values["n"] * 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    lines = []
    fit(path, memory="150 MB", scale="n", engines=["torch"], params={"n": 32}, progress=lines.append,
        search=THOROUGH.verifying(True))
    phases = [re.match(r"phase (\d+)/(\d+): (.*)", line) for line in lines]
    phases = [(int(m[1]), int(m[2]), m[3]) for m in phases if m]
    assert [number for number, _, _ in phases] == sorted({number for number, _, _ in phases})  # each once, in order
    assert {of for _, of, _ in phases} == {7} and phases[0][2] == "the grid"
    # a phase is announced before its first line, and a phase with nothing to do not at all: totals that grow
    # need no point farther out
    assert "farther out, where the totals do not grow" not in [name for _, _, name in phases]
    assert "confirming the largest" in [name for _, _, name in phases]
    # the grid's processes are counted against those planned; a search's, asked for one at a time, by how many ran
    first_process = next(index for index, line in enumerate(lines) if re.match(r"\[1/4, ", line))
    assert lines.index("phase 1/7: the grid") < first_process
    searched = [line for line in lines if line.startswith("confirming torch at")]
    assert searched == [] and any(re.match(r"\[5, \d+:\d\d\] confirming torch at n=", line) for line in lines)
