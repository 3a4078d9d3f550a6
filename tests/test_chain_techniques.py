"""The memory techniques on the built-in chains: torch.compile (compiled in the set-up, never in a measured call)
and torch-autocast (float32 data only, judged with bfloat16's tolerance array by array)."""

import json

import numpy as np
import pytest
import torch

from benchlib.report.tables.engine_summary import comparison_text
from benchlib.engines import compiling, get_engine
from benchlib.engines.gradients import LOST_ARRAY, array_floor, load_gradient, max_relative_error
from benchlib.measure import Device, MemoryTimeline
from benchlib.measure.case_child import NotApplicable
from benchlib.report.tables.answers import answer_table
from benchlib.trials.cases import GradientMismatch
from benchlib.workloads import dot_chain, rnn

CPU = Device("cpu")


@pytest.mark.parametrize("workload", ["dot_chain", "rnn"])
def test_the_chains_compile_in_the_set_up_and_never_in_a_measured_call(workload, counting_backend, tmp_path):
    if workload == "dot_chain":
        case = dot_chain.case(device=CPU, engine="torch.compile", D=8, depth=5, dtype="float32",
                              gradient_dir=str(tmp_path))
    else:
        case = rnn.case(device=CPU, engine="torch.compile", batch=2, hidden=8, T=4, dtype="float32",
                        gradient_dir=str(tmp_path))
    compiled = counting_backend.graphs
    assert compiled >= 1
    # measured calls run under a memory timeline whose phase marks the loss makes: marks run between the
    # graphs, so a timeline that is active (or not) never makes the compiler trace again
    with MemoryTimeline(CPU, 0.01):
        result = case.fn()
    case.fn()
    assert counting_backend.graphs == compiled
    checks = case.check(result)
    assert checks["compile_time"] > 0


def test_a_chain_the_compiler_cannot_compile_is_not_applicable(monkeypatch, tmp_path):
    import torch._dynamo

    def failing(graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    torch._dynamo.reset()
    monkeypatch.setattr(compiling, "COMPILE_BACKEND", failing)
    try:
        with pytest.raises(NotApplicable, match="torch.compile could not compile this step: BackendCompilerFailed"):
            dot_chain.case(device=CPU, engine="torch.compile", D=8, depth=3, dtype="float32",
                           gradient_dir=str(tmp_path))
    finally:
        torch._dynamo.reset()


def test_autocast_applies_to_float32_data_only_and_records_bfloat16():
    autocast = get_engine("torch-autocast")
    assert autocast.not_applicable(CPU, "float32") is None
    reason = autocast.not_applicable(CPU, "float64")
    assert "autocast lowers float32 operations to bfloat16 and leaves float64 ones as they are" in reason
    assert "dtype=float32 lets it apply" in reason
    assert autocast.computes_in("float32") == "bfloat16"
    assert get_engine("torch").computes_in("float32") == "float32"


def _comparison(module, **values):
    config = module.BENCHMARK.config({**values, "trials": 1})
    return module.run(config, "cpu", progress=None)


@pytest.mark.slow
def test_dot_chain_at_float64_records_autocast_as_not_applicable_with_its_reason():
    comparison = _comparison(dot_chain, D=8, depth=3, dtype="float64", engines=["manual", "torch-autocast"])
    assert [(p.engine, p.status) for p in comparison.problems] == [("torch-autocast", "not applicable")]
    assert "dtype=float32" in comparison.problems[0].message


@pytest.mark.slow
def test_dot_chain_at_float32_judges_autocast_at_bfloat16_and_compile_at_float32():
    comparison = _comparison(dot_chain, D=16, depth=4, dtype="float32",
                             engines=["manual", "torch-autocast", "torch.compile"])
    frame = comparison.frame()
    errors = frame[frame["metric"] == "grad_max_rel_err"].set_index("variant")
    assert errors.loc["torch-autocast", "dtype"] == "bfloat16"
    assert 1e-3 < errors.loc["torch-autocast", "value"] <= 5e-2  # past float32's tolerance, within bfloat16's
    assert errors.loc["torch.compile", "dtype"] == "float32" and errors.loc["torch.compile", "value"] <= 1e-3
    assert comparison.ok and not comparison.problems
    assert "within the bfloat16 tolerance 0.05" in comparison.check_gradients()
    compile_time = frame[frame["metric"] == "compile_time"]
    assert list(compile_time["variant"]) == ["torch.compile"] and (compile_time["value"] > 0).all()
    # shown apart from the step's time: in the summary, the printed table and the report's answer table
    summary = comparison.summary_frame().set_index("engine")
    assert summary.loc["torch.compile", "compile_s"] == compile_time["value"].iloc[0]
    assert summary[["compile_s"]].drop(index="torch.compile").isna().all().all()
    assert "compile_s" in comparison_text(comparison).splitlines()[0]
    answers = answer_table(comparison.summary_frame())
    assert list(answers.loc[answers["engine"] == "torch.compile", "compile (apart)"] != "") == [True]


@pytest.mark.slow
def test_autocast_loses_whole_gradients_of_the_seeds_rnn_so_it_is_not_a_default_engine(tmp_path):
    # the seed's weights are of scale 0.01: in bfloat16, Wout's and b's gradients vanish while bout's, the largest,
    # stays right; one error relative to the largest entry would read 3e-2 and pass
    for engine in ("manual", "torch-autocast"):
        case = rnn.case(device=CPU, engine=engine, batch=2, hidden=32, T=4, dtype="float32",
                        gradient_dir=str(tmp_path))
        case.check(case.fn())
    got, want = load_gradient(tmp_path, "torch-autocast"), load_gradient(tmp_path, "manual")
    assert max_relative_error(got, want) <= 5e-2
    assert max_relative_error(got, want, floor=array_floor("bfloat16")) > LOST_ARRAY
    comparison = _comparison(rnn, batch=2, hidden=32, T=4, T_sweep=[4], engines=["manual", "torch-autocast"])
    assert [(p.engine, p.status) for p in comparison.problems] == [("torch-autocast", "failed")]
    assert "agrees with manual's within the bfloat16 tolerance 0.05 as a whole, but one array of it differs by 1 of " \
           "its own size, past 0.5: bfloat16 lost it" in comparison.problems[0].message
    assert "torch-autocast" not in rnn.BENCHMARK.parameter("engines").default


def test_half_precision_gradients_are_also_judged_array_by_array_down_to_what_the_dtype_resolves():
    floor = array_floor("bfloat16")
    assert array_floor("float32") is None and array_floor("float64") is None and floor == 2.0 ** -8
    small = np.array([0.04, -0.04])
    reference = [np.array([1.0, 2.0]), small]
    lost = [np.array([1.0, 2.0]), np.zeros(2)]
    assert max_relative_error(lost, reference) == pytest.approx(2e-2)  # beside the largest entry: agreement
    assert max_relative_error(lost, reference, floor=floor) == pytest.approx(1.0)  # the small array is gone
    # an array below what bfloat16 resolves beside the largest (a bias BatchNorm cancels) is judged against that
    # share, not against its own rounding-sized scale
    cancelled = [np.array([1.0, 2.0]), np.array([1e-6, -1e-6])]
    noisy = [np.array([1.0, 2.0]), np.array([3e-4, 0.0])]
    assert max_relative_error(noisy, cancelled, floor=floor) == pytest.approx(2.99e-4 / (2 * floor))
    assert max_relative_error(noisy, cancelled, floor=floor) < LOST_ARRAY < max_relative_error(lost, reference,
                                                                                               floor=floor)
    assert np.isnan(max_relative_error([np.array([np.nan]), small], [np.array([1.0]), small], floor=floor))


@pytest.mark.slow
def test_a_lost_array_is_a_mismatch_listed_first_and_the_sweep_measures_w_in_the_datas_dtype():
    comparison = _comparison(rnn, batch=2, hidden=32, T=4, T_sweep=[2], engines=["manual", "torch-autocast"])
    mismatches = comparison.gradient_mismatches()
    assert set(mismatches["engine"]) == {"torch-autocast"} and LOST_ARRAY in set(mismatches["tolerance"])
    with pytest.raises(GradientMismatch, match="an array lost at half precision"):
        comparison.check_gradients()
    text = comparison.check_gradients(raise_on_mismatch=False)
    assert text.startswith("rnn_fanout: gradients disagree with manual") and "torch-autocast" in text
    assert not comparison.ok
    frame = comparison.frame()
    autocast = frame[(frame["variant"] == "torch-autocast") & (frame["metric"] == "peak_bytes")]
    assert set(autocast["dtype"]) == {"bfloat16"}
    assert {json.loads(p)["data_dtype"] for p in autocast["params"]} == {"float32"}
    growth = rnn.growth_per_step(frame).set_index("engine")
    slope = growth.loc["torch-autocast", "peak_bytes_per_step"]
    assert growth.loc["torch-autocast", "peak_per_step_in_W"] == pytest.approx(slope / (32 * 32 * 4))


@pytest.mark.slow
def test_an_opted_in_engine_that_fails_leaves_a_partial_run_with_every_figure(tmp_path):
    import io

    from benchlib.runner import run

    result = run(["rnn_fanout"], device="cpu", out=tmp_path, quick=True, progress=False, stream=io.StringIO(),
                 params={"engines": ["manual", "torch", "torch-autocast"]})
    assert [outcome.status for outcome in result.notebooks] == ["partial"]
    assert "torch-autocast" in result.notebooks[0].error
    for figure in ("rnn_fanout_memory_timeline", "rnn_fanout_peak", "rnn_fanout_sweep"):
        assert (result.path / "figures" / f"{figure}.html").is_file()


CHAIN_IMPORTS_CHILD = """
import json, os, sys, tempfile
import torch
from benchlib.engines import compiling
from benchlib.measure import Device
from benchlib.workloads import dot_chain, rnn
compiling.COMPILE_BACKEND = "eager"  # dynamo without inductor: it imports the same stack, in a fraction of the time
for engine in sys.argv[1:]:
    for workload in ("dot_chain", "rnn"):
        pid = os.fork()
        if pid == 0:
            with tempfile.TemporaryDirectory() as gradients:
                if workload == "dot_chain":
                    case = dot_chain.case(device=Device("cpu"), engine=engine, D=8, depth=6, dtype="float32",
                                          gradient_dir=gradients)
                else:
                    case = rnn.case(device=Device("cpu"), engine=engine, batch=2, hidden=8, T=4, dtype="float32",
                                    gradient_dir=gradients)
                case.fn()
                print(json.dumps([engine, workload, "torch._dynamo" in sys.modules]), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
"""


@pytest.mark.slow
def test_a_template_preloads_torch_dynamo_exactly_for_the_chain_engines_that_import_it():
    # What a fork template preloads (`case_imports`) must be what the case imports anyway: more puts objects in
    # its heap a fresh process has not, less leaves 0.9 s of import in every trial's set-up
    import subprocess
    import sys

    from benchlib.engines import DYNAMO, ENGINE_NAMES, case_imports

    torch_engines = [name for name in ENGINE_NAMES if "torch" in case_imports(name, CPU)]
    out = subprocess.run([sys.executable, "-c", CHAIN_IMPORTS_CHILD, *torch_engines],
                         capture_output=True, text=True, check=True).stdout
    seen = [json.loads(line) for line in out.splitlines()]
    assert len(seen) == 2 * len(torch_engines)
    assert all(imported == (DYNAMO in case_imports(engine, CPU)) for engine, _, imported in seen), seen
    assert any(imported for *_, imported in seen) and not all(imported for *_, imported in seen)
    assert case_imports("manual", CPU) == () and case_imports("torch.func", CPU) == ("torch",)
