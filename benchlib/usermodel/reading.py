"""Model files read and checked in a child process, so the runner never runs the user's code itself.

Reading a model file imports it (its module-level code runs) and the form check calls its `model`,
`batch` and `loss`: code that may exit the process, hang, or leave a thread running. `benchlib run`
plans in its own process, so all of that happens here instead, in `python -m
benchlib.usermodel.reading`, under a time limit: the child reads and checks the files
(`declare_model_files`, exactly as in-process) and sends back their facts (paths, NAME, form,
PARAMETERS, QUICK) as JSON; the parent builds the same `Benchmark` from them (`declaration`), whose
`measure` reads the files again where it runs: in the notebook's kernel, itself a child.
Each group of files is read once per call; `declare_in_child` takes several groups at once.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib.errors import Refused
from benchlib.benchmark import Benchmark, DeclarationError
from benchlib.measure.devices import resident_high_water
from benchlib.records.environment import note_torch_facts
from benchlib.usermodel.loader import ModelFileError

FORM_CHECK_TIMEOUT_S = 120.0  # importing a file and one loss call at its QUICK values; BENCHLIB_FORM_CHECK_TIMEOUT
TIMEOUT_ENV = "BENCHLIB_FORM_CHECK_TIMEOUT"


@dataclass(frozen=True)
class FileFacts:
    """What the parent needs of a model file that a child read: no code of the user's."""

    path: Path
    name: str
    parameters: dict[str, Any]
    quick: dict[str, Any]
    techniques: dict[str, list[str]] = field(default_factory=dict)  # its own TECHNIQUES: name -> aspects changed
    has_optimizer: bool = False  # it defines optimizer(parameters)
    arrays: bool = False  # it is in the array form
    # the reading process's resident high-water mark once it had read the file (torch imported, the model built at its
    # QUICK values): what any process that steps it holds at least, a rank among them
    resident_bytes: int | None = None
    # the same process's resident memory once it had imported torch, before the file: no process that steps the file
    # on the CPU holds less (a limit below it cannot be met)
    interpreter_bytes: int | None = None
    # the integer parameters whose value changes the batch's shapes (None: not known): what --global-batch may split
    batch_parameters: tuple[str, ...] | None = None


def measure_reading(paths: Sequence[str], *args, **kwargs):
    """Measure the files, read where this runs (the kernel): the parent never imported them."""
    from benchlib.usermodel import load_model_files

    return load_model_files(paths).measure(*args, **kwargs)


def _facts(group: Sequence[str], shapes_only: bool = False) -> dict:
    """In the child: the group read and checked as in-process, reported as JSON-able facts."""
    from benchlib.usermodel import declare_model_files
    from benchlib.usermodel.arrays import ArrayModelFile

    _, files, _ = declare_model_files(group, shapes_only)
    return {"arrays": isinstance(files[0], ArrayModelFile), "resident_bytes": resident_high_water(),
            "files": [{"path": str(f.path), "name": f.name, "parameters": f.parameters, "quick": f.quick,
                       "techniques": {name: [aspect.name for aspect in technique.changes]
                                      for name, technique in getattr(f, "techniques", {}).items()},
                       "has_optimizer": getattr(f, "optimizer", None) is not None,
                       "batch_parameters": None if isinstance(f, ArrayModelFile) else _batch_parameters(f)}
                      for f in files]}


def _batch_parameters(model_file) -> list[str] | None:
    """The integer parameters whose value changes the shapes batch() gives: batch() called at the values the form
    check steps (QUICK over the defaults) and at each integer one more. Real calls, as the check's own: meta or fake
    tensors would import torch's symbolic-shape stack (0.7-2 s of every reading) and fail on a batch that reads its
    values. None where batch() fails so."""
    values, found = {**model_file.parameters, **model_file.quick}, []
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        try:
            shapes = [[tuple(getattr(t, "shape", ())) for t in (made if isinstance(made, (tuple, list)) else (made,))]
                      for made in (model_file.batch(**{**values, name: at}) for at in (value, value + 1))]
        except Exception:  # noqa: BLE001 - a batch that refuses a value: not known, so nothing is refused
            return None
        if shapes[0] != shapes[1]:
            found.append(name)
    return found


def _stray_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate()
            if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()]


def read_outcome(group: Sequence[str], shapes_only: bool = False) -> dict:
    """One group's facts as JSON values, or {"error", "traceback"} saying why its files are refused: what the child
    sends back for it (`child_main`; tests of fit's search call it in their own process)."""
    try:
        outcome = _facts(group, shapes_only)
    except (ModelFileError, DeclarationError) as error:
        return {"error": str(error), "traceback": traceback.format_exc()}
    except Exception as error:  # noqa: BLE001 - the user's code: name it; --debug shows the traceback
        return {"error": f"{group[0]}: reading the file raised {type(error).__name__}: {error}",
                "traceback": traceback.format_exc()}
    try:
        json.dumps(outcome, allow_nan=False)
    except (TypeError, ValueError) as error:  # PARAMETERS that JSON cannot carry
        return {"error": f"{group[0]}: PARAMETERS and QUICK must be numbers, strings, booleans or lists of them "
                         f"({error})"}
    return outcome


def child_main(result_path: str) -> None:
    """Read groups of paths (JSON on stdin), write one outcome per group to `result_path`, with what torch reports
    here (`torch_facts`, for the parent's run.json: it imports no torch), and leave at once: a thread the user's
    code started cannot keep this process, and says so."""
    import torch  # noqa: F401  (what every process that steps a file holds first: `FileFacts.interpreter_bytes`)

    from benchlib.records.environment import torch_facts

    interpreter = resident_high_water()
    asked = json.load(sys.stdin)
    outcomes = []
    for group in asked["groups"]:
        outcome = {**read_outcome(group, asked["shapes_only"]), "interpreter_bytes": interpreter}
        stray = _stray_threads()
        if stray and "error" not in outcome:  # this group's code started them: its refusal, no other's
            outcome = {"error": f"{', '.join(map(str, group))}: the file's code started thread(s) {', '.join(stray)} "
                                "that are still running after the form check; benchlib's processes would never exit "
                                "(make them daemon threads, or start them inside a function benchlib does not call)"}
        outcomes.append(outcome)
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump({"outcomes": outcomes, "torch": torch_facts()}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable `name`, else `default`; ValueError saying what is valid."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise Refused(f"{name} must be a number of seconds > 0, got {text!r}")
    return value


def timeout_s() -> float:
    """The form check's time limit: `BENCHLIB_FORM_CHECK_TIMEOUT` seconds, else `FORM_CHECK_TIMEOUT_S`."""
    try:
        return env_seconds(TIMEOUT_ENV, FORM_CHECK_TIMEOUT_S)
    except ValueError as error:
        raise ModelFileError(str(error)) from None


def read_in_child(groups: Sequence[Sequence[str]], shapes_only: bool = False) -> list[list[FileFacts] | ModelFileError]:
    """Per group of model-file paths (versions of one NAME), the facts of its files, or the `ModelFileError` that
    says why they were refused, all read and checked in one child under the time limit (`shapes_only`: a
    prediction's, from shapes alone where the step allows: `loader.check_form`). A child that exits before it
    answers, hangs or is killed refuses every group, naming what happened."""
    limit = timeout_s()
    with tempfile.TemporaryDirectory(prefix="benchlib-reading-") as folder:
        result_path, output_path = Path(folder) / "result.json", Path(folder) / "output.txt"
        with open(output_path, "w") as output:
            process = subprocess.Popen([sys.executable, "-m", "benchlib.usermodel.reading", str(result_path)],
                                       stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True, text=True)
            try:
                process.communicate(json.dumps({"groups": [list(map(str, group)) for group in groups],
                                                "shapes_only": shapes_only}), timeout=limit)
            except subprocess.TimeoutExpired:
                reason = (f"did not finish within {limit:g} s (importing it and building the model and batch at the "
                          f"QUICK values, one loss call); set {TIMEOUT_ENV} for a slower file")
                return [ModelFileError(f"{', '.join(map(str, group))}: the form check {reason}") for group in groups]
            finally:  # answered, timed out or interrupted: nothing the file's code started keeps running
                _kill(process)
        said = output_path.read_text(errors="replace").strip()
        if not result_path.is_file():
            why = (f"ended with exit status {process.returncode}" if process.returncode >= 0
                   else f"was killed by {signal.Signals(-process.returncode).name}")
            tail = f"; its last output: {said[-500:]}" if said else ""
            return [ModelFileError(f"{', '.join(map(str, group))}: the process checking the file {why} before it "
                                   f"answered (does the file's code exit the process, e.g. os._exit or sys.exit?){tail}")
                    for group in groups]
        answered = json.loads(result_path.read_text(encoding="utf-8"))
        note_torch_facts(answered["torch"])
        return answers(answered["outcomes"])


def answers(outcomes: Sequence[dict]) -> list[list[FileFacts] | ModelFileError]:
    """The child's outcomes (`read_outcome`, one per group) as each group's `FileFacts`, or its `ModelFileError`."""
    made: list[list[FileFacts] | ModelFileError] = []
    for outcome in outcomes:
        if "error" in outcome:
            refusal = ModelFileError(outcome["error"])
            refusal.child_traceback = outcome.get("traceback", "")  # what `benchlib --debug` shows
            made.append(refusal)
            continue
        made.append([FileFacts(Path(f["path"]), f["name"], f["parameters"], f["quick"], f["techniques"],
                               f["has_optimizer"], outcome["arrays"], outcome.get("resident_bytes"),
                               outcome.get("interpreter_bytes"),
                               None if f.get("batch_parameters") is None else tuple(f["batch_parameters"]))
                     for f in outcome["files"]])
    return made


def declare_in_child(groups: Sequence[Sequence[str]]) -> list[Benchmark | ModelFileError]:
    """Per group of model-file paths (versions of one NAME), its `Benchmark`, or the `ModelFileError` that
    says why the files were refused, all read and checked in one child under the time limit (`read_in_child`)."""
    declared: list[Benchmark | ModelFileError] = []
    for files in read_in_child(groups):
        if isinstance(files, ModelFileError):
            declared.append(files)
            continue
        from benchlib.usermodel.declare import declaration  # torch and the figures: only for a file that passed

        declared.append(declaration(files, files[0].arrays,
                                   functools.partial(measure_reading, [str(f.path) for f in files])))
    return declared


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


if __name__ == "__main__":
    child_main(sys.argv[1])
