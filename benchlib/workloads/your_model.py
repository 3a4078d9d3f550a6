"""your_model: notebooks/your_model.ipynb, a model file's run in a notebook (JupyterLab or the runner).

The notebook takes the file's path (`model_file`, a declared parameter the parameters cell shows so
a JupyterLab user sees where to set it); empty measures the commented example `benchlib new` writes.
The notebook runs the file through `benchlib.runner.declared.run_model_file`, as `benchlib run my_model.py`
does, into the same run.
"""

from __future__ import annotations

from benchlib.benchmark import Benchmark, Parameter

NAME = "your_model"


BENCHMARK = Benchmark(
    name=NAME,
    question="What does one gradient step of your model file cost in memory, allocations and time, under each engine?",
    cases="the cases of `benchlib run MODEL_FILE`: one training step per engine in fresh processes, trials interleaved",
    parameters=(Parameter("model_file", "", "path of a model file in the torch form (empty: benchlib new's example)"),
                Parameter("quick", False, "the file's QUICK values and fewer trials", quick=True)),
    notebook="your_model.ipynb",
)
