"""One engine's gradient of an array-form model file, set up in the isolation child (`run_isolated`'s target).

The child re-reads the file, builds the seeded params and data, hands them to the engine in its
own library and device (`Engine.asarray`), and measures one gradient of the loss with respect to
every params array; the check saves the last gradient for the parent to compare with torch's and, for
benchlib's own engines, reads memory by role (saved values, gradients) off the tape of the last call.
"""

from __future__ import annotations

from benchlib.engines.functional import array_engine, gradient_maker
from benchlib.engines.gradients import require_finite, save_gradient
from benchlib.engines.roles import tape_roles
from benchlib.measure import Case
from benchlib.usermodel.arrays import engine_namespace, read_array_file
from benchlib.usermodel.loader import guarded


def case(*, device, path: str, engine: str, values: dict, gradient_dir: str) -> Case:
    model_file = read_array_file(path)
    params, data = guarded(model_file, "params or data (building the case)", model_file.build, values)
    arrays_engine = array_engine(engine)
    arrays = [arrays_engine.asarray(array, device) for array in (*params, *data)]
    xp = engine_namespace(engine, device.name)
    gradient = gradient_maker(engine)(lambda *inputs: model_file.loss(xp, *inputs), tuple(range(len(params))))

    def check(result) -> dict[str, float]:
        require_finite(result)  # a NaN step fails, never passes unnoticed
        save_gradient(result, gradient_dir, engine)
        return tape_roles(gradient)  # benchlib's engines: saved values and gradients at the peak, from the tape

    return Case(lambda: guarded(model_file, f"the {engine} gradient", gradient, *arrays), check)
