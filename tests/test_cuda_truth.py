"""fit's CUDA prediction against GPU-measured truth (results/reference/cuda-truth/): every row predicted on this
CPU, with the kernels the torch release it was measured with chooses on the GPU it was measured on (both read from
the table's header), within 5% of its reserved peak, and over the limit wherever the GPU measured over it (so no
answer lies past a batch the GPU could not hold). A table's columns besides model, engine and what was measured are
the model file's parameters (tools/cuda_truth.py adds rows). Autocast's op lists are the installed torch's."""

import re
from pathlib import Path

import pandas as pd
import pytest

from benchlib.fit.cuda_policy import gpu_named, torch_named
from benchlib.fit.predicted import TRACE_TOLERANCE, predict_reserved
from benchlib.units import format_bytes
from benchlib.usermodel.loader import read_model_file

TRUTH = Path(__file__).resolve().parents[1] / "results" / "reference" / "cuda-truth"
LIMIT = 80 * 2**30  # the limit the rows were measured around (80 GiB)


def truth_tables() -> list[Path]:
    return sorted(TRUTH.glob("*.csv"))


@pytest.mark.slow  # minutes: a 124M-parameter model traced at every measured batch (it starts no process)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("table", truth_tables(), ids=lambda path: path.stem)
def test_every_measured_row_is_predicted_within_five_percent_and_over_the_limit_where_the_gpu_was(table):
    pytest.importorskip("transformers", reason="the truth models are transformers' (pip install -e '.[hf]')")
    rows = pd.read_csv(table, comment="#")
    gpu = gpu_named(table.stem.rsplit("_", 1)[1])  # gpt2_124m_h200.csv: measured on an H200
    rules = torch_named(re.search(r"torch (\d+\.\d+)", table.read_text().split("\n", 1)[0])[1])
    parameters = [column for column in rows.columns
                  if column not in ("model", "engine", "reserved_bytes", "allocated_bytes", "source")]
    predicted = {}
    for key, _ in rows.groupby(["model", "engine", *parameters]):
        model_file = read_model_file(TRUTH / f"{key[0]}.py")
        values = {name: getattr(value, "item", lambda: value)() for name, value in zip(parameters, key[2:])}
        predicted[key] = predict_reserved(model_file, key[1], values, gpu=gpu, rules=rules).reserved
    lines, misses = [], []
    for row in rows.itertuples():
        guess = predicted[(row.model, row.engine, *(getattr(row, name) for name in parameters))]
        error = guess / row.reserved_bytes - 1
        over_missed = row.reserved_bytes > LIMIT >= guess
        at = ", ".join(f"{name} {getattr(row, name)}" for name in parameters)
        lines.append(f"{row.model} {row.engine} {at} ({row.source}): measured "
                     f"{format_bytes(row.reserved_bytes)}, predicted {format_bytes(guess)} ({100 * error:+.2f}%)")
        if abs(error) > TRACE_TOLERANCE or over_missed:
            misses.append(lines[-1] + (" predicted under the limit the GPU went over" if over_missed else ""))
    print("\n".join(lines))
    assert not misses, "\n".join(misses)


def test_the_script_that_adds_rows_measures_only_on_a_gpu(capsys):
    import importlib.util

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would measure")
    spec = importlib.util.spec_from_file_location("cuda_truth", TRUTH.parents[2] / "tools" / "cuda_truth.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    before = {path: path.stat().st_mtime_ns for path in TRUTH.iterdir()}
    assert script.main([str(TRUTH / "gpt2_124m.py"), "--gpu", "h200", "--engines", "torch",
                        "--at", "batch_size=8"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err
    assert {path: path.stat().st_mtime_ns for path in TRUTH.iterdir()} == before  # nothing written
