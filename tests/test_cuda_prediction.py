"""`benchlib fit --device cuda` without a GPU: the caching allocator's model, the trace that feeds it, and the
command's answer labelled as a prediction."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchlib.measure.caching_allocator import (LARGE_SEGMENT, SMALL_SEGMENT, CachingAllocatorModel, round_size,
                                                segment_size)
from benchlib.records import load_records, load_run_info
from benchlib.runner.cli import main
from benchlib.fit import measured
from benchlib.fit.largest import fit
from benchlib.fit.predicted import ATTENTION, BASIS, RECURRENT, largest_fitting, predict_reserved
from benchlib.fit.search import SEARCH_LIMIT
from benchlib.fit.tracing import traced_peak, tracked_peak
from benchlib.usermodel.loader import read_model_file
from benchlib.usermodel.template import TEMPLATE
from test_fit import blocks_file, model_file

MiB = 1 << 20


def test_sizes_round_to_512_bytes_and_segments_follow_the_pools():
    assert [round_size(n) for n in (1, 512, 513, 1024)] == [512, 512, 1024, 1024]
    assert segment_size(MiB) == SMALL_SEGMENT  # the small pool's largest request
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == LARGE_SEGMENT
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 512) == 12 * MiB


def test_small_requests_share_a_segment_and_large_ones_split_theirs():
    allocator = CachingAllocatorModel()
    for key in range(3):
        allocator.malloc(key, 1000)
    assert (allocator.reserved, allocator.allocated, allocator.segments) == (SMALL_SEGMENT, 3 * 1024, 1)
    for key in range(3, 7):  # four 5 MiB requests fill one 20 MiB segment, the fifth takes a new one
        allocator.malloc(key, 5 * MiB)
    assert allocator.reserved == SMALL_SEGMENT + LARGE_SEGMENT
    allocator.malloc(7, 5 * MiB)
    assert allocator.reserved == SMALL_SEGMENT + 2 * LARGE_SEGMENT


def test_a_large_block_is_not_split_when_less_than_a_mebibyte_would_remain():
    allocator = CachingAllocatorModel()
    allocator.malloc("a", 19 * MiB + MiB // 2)  # 20 MiB segment; 0.5 MiB left over stays in the block
    assert allocator.allocated == LARGE_SEGMENT
    allocator.free("a")
    allocator.malloc("b", 2 * MiB)  # the freed block is reused and split: 18 MiB remain
    assert (allocator.allocated, allocator.reserved) == (2 * MiB, LARGE_SEGMENT)


def test_freed_neighbours_merge_and_the_pools_stay_apart():
    allocator = CachingAllocatorModel()
    for key in "abcd":
        allocator.malloc(key, 5 * MiB)
    allocator.free("a")
    allocator.free("b")
    allocator.malloc("e", 9 * MiB)  # only the merged 10 MiB of a and b holds it
    assert (allocator.reserved, allocator.segments) == (LARGE_SEGMENT, 1)
    allocator.free("e")
    allocator.malloc("small", 1000)  # a small request never takes a large block
    assert allocator.reserved == LARGE_SEGMENT + SMALL_SEGMENT
    assert allocator.peak_reserved == allocator.reserved  # segments are never handed back


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 24 * MiB)), max_size=60))
def test_reserved_holds_every_block_never_falls_and_everything_freed_leaves_nothing_allocated(steps):
    allocator = CachingAllocatorModel()
    live, reserved = [], 0
    for index, (allocate, nbytes) in enumerate(steps):
        if allocate or not live:
            allocator.malloc(index, nbytes)
            live.append((index, nbytes))
        else:
            allocator.free(live.pop(nbytes % len(live))[0])
        assert allocator.allocated >= sum(round_size(n) for _, n in live)
        assert allocator.allocated <= allocator.reserved == allocator.peak_reserved >= reserved
        reserved = allocator.reserved
    for key, _ in live:
        allocator.free(key)
    assert allocator.allocated == 0 and allocator.reserved == reserved


def test_the_search_over_traces_finds_the_largest_fitting_value_and_a_line_in_two_traces():
    calls = []

    def linear(value):
        calls.append(value)
        return 1000 + 10 * value

    assert largest_fitting(linear, {8: linear(8), 64: linear(64)}, limit=3000) == 200
    assert calls[2:] == [200, 201]  # where the line meets the limit, and its neighbour
    calls.clear()
    assert largest_fitting(linear, {8: linear(8), 64: linear(64), 512: linear(512)}, limit=3005) == 200
    assert calls[3:] == [200, 201]  # between two traces as beyond them
    assert largest_fitting(linear, {8: linear(8)}, limit=1000) is None
    assert largest_fitting(lambda value: 5, {8: 5}, limit=10) == SEARCH_LIMIT  # a total that never grows
    calls.clear()
    assert largest_fitting(linear, {8: linear(8)}, limit=3000, reach=64) == 64  # fits at the reach: not traced beyond
    assert max(calls) == 64
    assert largest_fitting(linear, {8: linear(8)}, limit=1500, reach=64) == 50


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(1, 30), st.integers(0, 3000),
       st.sampled_from([0, 2, 5]))
def test_the_search_over_traces_answers_as_reading_every_value_would_for_any_rising_curve(rises, start, limit, power):
    """Steps (segments), plateaus and curves (attention's square): the answer of a value-by-value walk, in at most
    three traces per halving of the interval."""
    def peak(value):  # nondecreasing: a sum of the rises passed, times the value's power
        return sum(rises[:value % len(rises)]) + (value // len(rises)) * sum(rises) + value ** power // 10

    calls = []
    traced = {start: peak(start), 8 * start: peak(8 * start)}
    answer = largest_fitting(lambda value: calls.append(value) or peak(value), traced, limit, reach=4096)
    walked = None if peak(start) > limit else next(
        (value - 1 for value in range(start, 4097) if peak(value) > limit), 4096)
    assert answer == walked
    assert len(calls) <= 3 * (4096).bit_length() + 2


def test_a_few_operators_fewer_at_a_value_of_one_is_no_loop_and_the_search_traces_on(tmp_path, monkeypatch):
    """GPT-2's checkpointed step dispatches 20 operators fewer of 31164 at batch 1 (a squeezed dimension): traced to
    its answer, not extrapolated from 8 times the value (which answered 118 where the H200 holds about 116)."""
    from benchlib.fit import predicted as cuda_prediction

    asked = []

    def fake_trace(model_file, engine, values, **_):
        asked.append(values["n"])
        return cuda_prediction.Prediction(100 * MiB + values["n"] * MiB, 0, 1,
                                          operators=31144 if values["n"] == 1 else 31164)

    monkeypatch.setattr(cuda_prediction, "predict_reserved", fake_trace)
    made = cuda_prediction.predict_engine(read_model_file(model_file(tmp_path)), "torch", {"width": 16, "n": 8}, "n", 1100 * MiB)
    assert made["reach"] is None and made["largest"] == 1000 and max(asked) > 8 * 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, --device cuda measures")
def test_a_step_whose_operators_grow_with_the_value_is_traced_no_farther_than_eight_times_it(fit_children_here, tmp_path, monkeypatch):
    from benchlib.fit import predicted as cuda_prediction

    asked = []

    def fake_trace(model_file, engine, values, **_):  # a loop over the value: one more operator per unit
        asked.append(values["n"])
        return cuda_prediction.Prediction(100 * MiB + values["n"] * MiB, 0, 1, operators=values["n"])

    monkeypatch.setattr(cuda_prediction, "predict_reserved", fake_trace)
    path = model_file(tmp_path)
    result = fit(path, memory=100 * MiB + 1000 * MiB + MiB // 2, scale="n", device="cuda", engines=["torch"],
                 params={"n": 16}, progress=lambda line: None)  # half a step above the answer: no tie to round
    (torch_fit,) = result.engines
    assert max(asked) == 8 * 16 and torch_fit.max_fitting == 1000  # the linear size model, beyond the traces
    assert "n=1000, extrapolated (linear model past the farthest trace, 128" in "\n".join(result.lines())
    (answer,) = [row for row in result.records() if row["metric"] == "max_fitting"]
    assert json.loads(answer["params"])["extrapolated_beyond"] == 128
    line = [json.loads(row["params"])["value"] for row in result.records() if row["metric"] == "predicted_total_bytes"
            and json.loads(row["params"])["model"] == "linear"]  # the figure's line: through the traces, past 1000
    assert min(line) == 2 and 1000 in line and max(line) > 1000


@pytest.mark.parametrize("engine", ["torch", "torch-checkpoint", "fused-optimizer"])
def test_the_fake_tensor_trace_replays_the_same_allocations_as_real_tensors(tmp_path, engine):
    file = blocks_file(tmp_path)
    for n in (4, 64):
        fake = predict_reserved(file, engine, {"n": n}, workspaces=())
        real = predict_reserved(file, engine, {"n": n}, workspaces=(), fake=False)
        assert (fake.reserved, fake.allocated, fake.segments) == (real.reserved, real.allocated, real.segments)
        parameters = sum(round_size(p.numel() * p.element_size()) for p in file.build({"n": n})[0].parameters())
        assert fake.allocated >= 3 * parameters  # parameters and Adam's two moments at least, gradients besides
    wide = predict_reserved(file, engine, {"n": 4_000_000}, workspaces=())  # 256 MB of batch: traced, never held
    assert wide.reserved > 256e6
    # cuBLAS's two 32 MiB workspaces: two large segments of their own, besides the step's
    bare = predict_reserved(file, engine, {"n": 4}, workspaces=())
    assert predict_reserved(file, engine, {"n": 4}).reserved == bare.reserved + 64 * MiB


KEEPS_A_TENSOR_PER_STEP = """
import torch
PARAMETERS = {"n": 8}
KEPT = []
def model(n):
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
def batch(n):
    return (torch.randn(n, 16),)
def loss(model, x):
    hidden = model[1](model[0](x))
    KEPT.append(hidden.detach() * 1)  # a step that keeps what it made: no step repeats the one before
    return model[2](hidden).square().mean()
def optimizer(parameters):
    return torch.optim.Adam(parameters)
"""


@pytest.mark.parametrize("engine", ["torch", "torch-checkpoint", "torch-autocast", "fused-optimizer"])
def test_the_steps_after_the_steady_one_replay_what_tracing_them_allocates(tmp_path, monkeypatch, engine):
    from benchlib.fit import predicted

    replays = []
    monkeypatch.setattr(predicted, "_replay", lambda *args, real=predicted._replay: replays.append(real(*args))
                        or replays[-1])
    (tmp_path / "kept.py").write_text(KEEPS_A_TENSOR_PER_STEP)
    for file, steady in ((blocks_file(tmp_path), True), (read_model_file(tmp_path / "kept.py"), False)):
        replayed = predict_reserved(file, engine, {"n": 64})
        assert replays.pop() is steady  # a step that keeps more each time is traced to the end, not replayed
        monkeypatch.setattr(predicted, "STEPS_TRACED", predicted.STEPS)  # every step traced
        traced = predict_reserved(file, engine, {"n": 64})
        monkeypatch.setattr(predicted, "STEPS_TRACED", 2)
        assert (replayed.reserved, replayed.allocated, replayed.segments) == \
            (traced.reserved, traced.allocated, traced.segments)

def test_a_model_that_deep_copies_its_layers_as_it_is_built_is_traced(tmp_path):
    """nn.TransformerEncoder copies its layer: built under the fake mode, those copies held another mode's tensors.
    Both traces (the GPU's allocator replay and the CPU's live bytes) build it on the meta device."""
    (tmp_path / "encoder.py").write_text(
        "import torch\nfrom torch import nn\nPARAMETERS = {'batch_size': 4}\n"
        "def model(batch_size):\n"
        "    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)\n"
        "    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)\n"
        "def batch(batch_size):\n    return (torch.randn(batch_size, 8, 32),)\n"
        "def loss(model, x):\n    return model(x).square().mean()\n")
    file = read_model_file(tmp_path / "encoder.py")
    fake = predict_reserved(file, "torch", {"batch_size": 4}, workspaces=(), gpu=None)  # the CPU's attention, as real
    real = predict_reserved(file, "torch", {"batch_size": 4}, workspaces=(), fake=False)
    assert (fake.reserved, fake.allocated) == (real.reserved, real.allocated) and fake.allocated > 0
    # the CPU's trace (fit's trace model) builds it the same way
    assert traced_peak(file, "torch", {"batch_size": 4}) == tracked_peak(file, "torch", {"batch_size": 4}) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, --device cuda measures")
@pytest.mark.slow  # its run directory's environment asks git
def test_fit_on_cuda_without_a_gpu_predicts_labels_everything_and_measures_nothing(fit_children_here, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(measured, "measure_step", None)  # any measurement would raise
    path = str(model_file(tmp_path))
    assert main(["fit", path, "--memory", "100 MB", "--scale", "n", "-p", "n=16", "--device", "cuda",
                 "--engines", "torch,torch-offload", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"tiny, {BASIS}: the largest n under 100.0 MB of CUDA reserved memory is" in out
    assert "  torch-offload  not predicted: its saved activations move to the host" in out
    (run,) = (tmp_path / "out").iterdir()
    records = load_records(run)
    assert set(records["metric"]) == {"predicted_total_bytes", "fit_check_error", "max_fitting", "not_applicable"}
    assert set(records["device"]) == {"cuda:0"} and records["params"].str.contains(BASIS).all()
    page = (run / "report.html").read_text()
    assert BASIS in page and "No verdicts" not in page
    engine_lines = [line for line in out.splitlines() if line.startswith("  torch")]
    assert len(engine_lines) == 2 and all("predicted" in line for line in engine_lines)
    assert main(["fit", path, "--memory", "100 MB", "--scale", "n", "--device", "cuda", "--engines", "torch-offload",
                 "--out", str(tmp_path / "none")]) == 1  # nothing could be predicted: said, recorded, not a crash
    assert "no engine could be predicted; each says why" in capsys.readouterr().out
    (run,) = (tmp_path / "none").iterdir()
    assert list(load_records(run)["metric"]) == ["not_applicable"]
    assert load_run_info(run)["device_requested"] == "cuda"
    assert main(["fit", path, "--memory", "100 MB", "--scale", "n", "--device", "cuda", "--verify",
                 "--out", str(tmp_path / "out2")]) == 2
    assert "this machine has no GPU" in capsys.readouterr().err and not (tmp_path / "out2").exists()
    for argv, message in ((["--device", "cuda", "--torch", "2.9"], "--torch '2.9' is not a release whose kernel "
                           "choices benchlib knows; known: 2.11, 2.12, 2.13"),
                          (["--torch", "2.11"], "--torch names what a prediction is made for, with --device cuda")):
        assert main(["fit", path, "--memory", "100 MB", "--scale", "n", *argv, "--out", str(tmp_path / "out3")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "out3").exists()


CONV_AND_ATTENTION = """
import torch

PARAMETERS = {"n": 8}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 3, padding=1)
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.conv(x).transpose(1, 2)
        return self.attention(h, h, h, need_weights=False)[0].mean()


def model(n):
    return Net()


def batch(n):
    return (torch.randn(n, 4, 16),)


def loss(model, x):
    return model(x)
"""


@pytest.mark.slow  # its run directory's environment asks git
def test_a_step_whose_cuda_kernels_choose_their_own_memory_is_predicted_as_a_floor_and_says_so(fit_children_here, tmp_path, monkeypatch,
                                                                                                  capsys):
    plain = predict_reserved(read_model_file(model_file(tmp_path)), "torch", {"width": 16, "n": 8})
    assert plain.unseen == frozenset()  # linear layers: what the trace sees is what CUDA allocates
    path = tmp_path / "convattn.py"
    path.write_text(CONV_AND_ATTENTION)
    traced = predict_reserved(read_model_file(path), "torch", {"n": 8})
    # the convolution's cuDNN algorithm is unseen; attention ran the kernel CUDA picks (cuda_policy), so is seen
    assert [why for why in traced.unseen if "cuDNN" in why] and not [why for why in traced.unseen if "attention" in why]
    assert traced.attention == {"efficient"}
    assert ATTENTION in predict_reserved(read_model_file(path), "torch", {"n": 8}, gpu=None).unseen  # the CPU's
    recurrent = tmp_path / "gru.py"  # the CPU decomposes a GRU into cells: told by its module, not an operator
    recurrent.write_text(CONV_AND_ATTENTION.replace("torch.nn.MultiheadAttention(8, 2, batch_first=True)",
                                                    "torch.nn.GRU(8, 8, batch_first=True)")
                         .replace("self.attention(h, h, h, need_weights=False)", "self.attention(h)"))
    assert RECURRENT in predict_reserved(read_model_file(recurrent), "torch", {"n": 8}).unseen
    monkeypatch.setattr(measured, "measure_step", None)
    assert main(["fit", str(path), "--memory", "100 MB", "--scale", "n", "--device", "cuda", "--engines", "torch",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "its memory is a floor, so this n is an upper bound: " in out and "cuDNN picks" in out and "confirm with --verify on the GPU" in out
    (run,) = (tmp_path / "out").iterdir()
    params = load_records(run)["params"].map(json.loads)
    assert all(len(p["unseen"]) == 1 for p in params)


REFERENCE_GPU_RUN = Path(__file__).parent.parent / "results" / "reference" / "20261126-011235-vm-cuda-0"


@pytest.mark.parametrize("engine", ["torch", "torch.func", "fused-optimizer"])
def test_the_prediction_matches_what_an_h200_reserved_for_the_template_model(tmp_path, engine):
    # the reference run measured `benchlib new`'s model on an NVIDIA H200 (torch 2.11, CUDA 13.0); the trace here
    # runs the CPU's operators under torch 2.13, yet lands on the same segments
    records = load_records(REFERENCE_GPU_RUN)
    measured = records[(records["benchmark"] == "my_mlp") & (records["metric"] == "cuda_reserved_peak_bytes")
                       & (records["variant"] == engine)]
    params = json.loads(measured["params"].iloc[0])
    path = tmp_path / "my_model.py"
    path.write_text(TEMPLATE)
    values = {name: params[name] for name in ("width", "depth", "batch_size")}
    assert predict_reserved(read_model_file(path), engine, values).reserved == int(measured["value"].median())


def test_a_predicted_total_carries_the_tolerance_the_gpu_truth_holds_traces_to():
    from benchlib.fit.predicted import TRACE_TOLERANCE
    from benchlib.fit.result import PREDICTED, EngineFit
    from benchlib.fit.sizing import LINEAR, SizeModel

    traced = {8: 800, 16: 1600, 32: 3200}
    fit_ = EngineFit("torch", model=SizeModel(LINEAR, (100.0, 0.0), 0.001), max_fitting=16, traced=traced,
                     tolerance=TRACE_TOLERANCE)
    assert fit_.total_at(16) == (1600.0, 1600 * (1 - TRACE_TOLERANCE), 1600 * (1 + TRACE_TOLERANCE), PREDICTED)
    low, high = fit_.model.bounds(20)  # no trace there: the size model's own interval
    assert fit_.total_at(20)[1:3] == (low, high) and high - low < 0.01 * 2000


BUILT_ON = """
from pathlib import Path
import torch
PARAMETERS = {"n": 8}
def model(n):
    layer = torch.nn.Linear(4, 4)
    READS_VALUES and float(layer.weight.detach().sum())  # a construction that reads a value: no meta tensor holds one
    Path(__file__).with_suffix(".built").write_text(layer.weight.device.type)
    return torch.nn.Sequential(layer, torch.nn.ReLU(), torch.nn.Linear(4, 1))
def batch(n):
    return (torch.randn(n, 4),)
def loss(model, x):
    return model(x).square().mean()
"""


@pytest.mark.parametrize("reads_values, built_on", [(False, "meta"), (True, "cpu")])
def test_a_predictions_engine_facts_build_the_model_on_the_meta_device_where_the_file_allows(tmp_path, reads_values,
                                                                                           built_on):
    from benchlib.fit.in_child import _in_child_engine_facts
    from benchlib.measure import resolve_device

    path = tmp_path / "built.py"
    path.write_text(f"READS_VALUES = {reads_values}\n" + BUILT_ON)
    made = _in_child_engine_facts(device=resolve_device("cpu"), path=str(path), values={"n": 8}, target="cuda:0",
                                  engines=["torch", "torch-checkpoint"], shapes_only=True)
    assert path.with_suffix(".built").read_text() == built_on
    assert made["reasons"] == {} and made["dtype"] == "float32"  # the same facts either way


LARGER_THAN_THIS_MACHINE = """
import torch
PARAMETERS = {"n": 8}
def model(n):
    return torch.nn.Sequential(torch.nn.Linear(100_000, 100_000), torch.nn.Linear(100_000, 1))  # 40 GB of weights
def batch(n):
    return (torch.randn(n, 100_000),)
def loss(model, x):
    out = model(x).square().mean()
    READS_A_VALUE and float(out.detach())  # a step that reads a value: fake tensors hold none
    return out
"""


def test_a_prediction_reads_and_checks_a_model_larger_than_this_machine_from_shapes_alone(tmp_path):
    from benchlib.usermodel import reading

    path = tmp_path / "huge.py"
    path.write_text("READS_A_VALUE = False\n" + LARGER_THAN_THIS_MACHINE)
    outcome = reading.read_outcome([str(path)], shapes_only=True)  # 40 GB built for real would not fit in 24 GB
    assert "error" not in outcome and outcome["files"][0]["parameters"] == {"n": 8}
    small = tmp_path / "reads.py"  # fake tensors cannot run it: checked with its real tensors, and passes
    small.write_text("READS_A_VALUE = True\n" + LARGER_THAN_THIS_MACHINE.replace("100_000", "16"))
    assert "error" not in reading.read_outcome([str(small)], shapes_only=True)
    broken = tmp_path / "broken.py"  # a real error is still the file's, said as without shapes_only
    broken.write_text("READS_A_VALUE = False\n" + LARGER_THAN_THIS_MACHINE.replace("100_000", "16")
                      .replace("return out", "return out.reshape(1)"))
    assert "must return a 0-dim tensor" in reading.read_outcome([str(broken)], shapes_only=True)["error"]
