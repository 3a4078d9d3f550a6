"""Isolation targets for tests/test_engines.py: a tiny case whose gradient is known, and can be made wrong."""

import numpy as np

from benchlib.engines.gradients import save_gradient
from benchlib.measure import Case


def case(*, device, engine, dtype, gradient_dir, failing="", off_by=0.0):
    """The gradient of sum(x²) at x = (1, 2, 3): 2x, times (1 + off_by) for every engine but manual."""
    if engine == failing:
        raise RuntimeError(f"{engine} fails on purpose")
    x = np.arange(1.0, 4.0, dtype=dtype)
    factor = 1.0 if engine == "manual" else 1.0 + off_by

    def check(result):
        save_gradient(result, gradient_dir, engine)
        return {}

    return Case(lambda: 2 * x * factor, check)
