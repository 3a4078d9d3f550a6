"""your_model: notebooks/your_model.ipynb, a model file's run in a notebook (JupyterLab or the runner).

The notebook takes the file's path (`model_file`, a declared parameter the parameters cell shows so
a JupyterLab user sees where to set it); empty measures the commented example `benchlib new` writes.
It runs the file through `run_declared`, as `benchlib run my_model.py` does, into the same run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchlib.benchmark import Benchmark, Parameter

NAME = "your_model"


def run_model_file(config, *, device: str = "auto", results_dir: str = ""):
    """The model file's records, summary and figures saved in `results_dir`; quick: at its QUICK values."""
    from benchlib.runner.declared import run_declared
    from benchlib.usermodel import load_model_file
    from benchlib.usermodel.template import TEMPLATE

    with tempfile.TemporaryDirectory(prefix="benchlib-example-") as folder:
        path = Path(config.model_file or Path(folder) / "my_model.py")
        if not config.model_file:
            path.write_text(TEMPLATE, encoding="utf-8")
        values = load_model_file(path).quick if config.quick else {}
        return run_declared(str(path), values, device=device, results_dir=results_dir)


BENCHMARK = Benchmark(
    name=NAME,
    question="What does one gradient step of your model file cost in memory, allocations and time, under each engine?",
    cases="the cases of `benchlib run MODEL_FILE`: one training step per engine in fresh processes, trials interleaved",
    parameters=(Parameter("model_file", "", "path of a model file in the torch form (empty: benchlib new's example)"),
                Parameter("quick", False, "the file's QUICK values and fewer trials", quick=True)),
    notebook="your_model.ipynb",
)
