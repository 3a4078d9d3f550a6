"""The CI recipe of docs/ci.md, run as written on a small model file: the baseline is recorded with the
docs' commands, the gate passes the same model, fails a wasteful version (exit 1) and cannot answer
against a baseline of another model (exit 2)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib.records.store import load_records, write_records_atomic

from test_pytest_plugin import LEAN, WASTEFUL

DOCS = Path(__file__).resolve().parents[1] / "docs" / "ci.md"


def _bash_block(containing: str) -> str:
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)
    return next(block for block in blocks if containing in block)


def _run(script: str, folder: Path, **env: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # the benchlib command of this environment
    return subprocess.run(["bash", "-c", script], cwd=folder, env={**os.environ, "PATH": path, **env},
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes of work beside the suite's other workers
def test_the_ci_recipe_passes_lean_fails_wasteful_and_refuses_a_foreign_baseline(tmp_path):
    record, gate = _bash_block("mkdir -p benchmarks/baseline"), _bash_block("benchlib compare")
    (tmp_path / "model.py").write_text(LEAN.replace('NAME = "mlp"\n', ""))
    recorded = _run(record, tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    assert (tmp_path / "benchmarks" / "baseline" / "records.parquet").is_file()

    same = _run(gate, tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr

    (tmp_path / "model.py").write_text(WASTEFUL.replace('NAME = "mlp"\n', ""))
    worse = _run(gate, tmp_path)
    assert worse.returncode == 1, worse.stdout + worse.stderr
    assert "model/step/torch/tracked_peak_bytes" in worse.stderr

    foreign = tmp_path / "benchmarks" / "foreign"
    foreign.mkdir()
    records = load_records(tmp_path / "benchmarks" / "baseline")
    write_records_atomic(records.assign(benchmark="another_model"), foreign / "records.parquet")
    # the block's compare line alone, against the candidate the wasteful gate just ran
    (compare,) = [line for line in gate.splitlines() if line.startswith("benchlib compare")]
    refused = _run(compare, tmp_path, BASELINE="benchmarks/foreign")
    assert refused.returncode == 2 and "nothing to compare" in refused.stderr
