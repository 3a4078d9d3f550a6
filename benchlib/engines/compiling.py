"""torch.compile as a gradient engine: compiled in the set-up, so no measured call pays for compiling.

A compiled function traces and compiles on its first call (and again for shapes it has not seen). Both
the registry's `torch.compile` (the built-in chains) and a model file's compiling engines make that
first call before anything is measured, time it as `compile_time`, and drop what it returned.
"""

from __future__ import annotations

from typing import Callable

COMPILE_BACKEND = "inductor"  # torch.compile's default; the tests swap in a counting fake


def compiled(fn: Callable, backend=None) -> Callable:
    """`fn` under torch.compile with `backend` (default: `COMPILE_BACKEND`, read now, so a test's swap holds): the
    one wrapper the built-in chains' engine, identical_closures' and a model file's techniques all use."""
    import torch

    return torch.compile(fn, backend=COMPILE_BACKEND if backend is None else backend)


def compiler_error(error: BaseException) -> bool:
    """Whether `error` is torch.compile's (dynamo's or its backend's), not the compiled code's own."""
    from torch._dynamo.exc import TorchDynamoException, TorchRuntimeError

    return isinstance(error, TorchDynamoException) and not isinstance(error, TorchRuntimeError) or \
        type(error).__module__.startswith("torch._inductor")


def run_marks_eagerly() -> None:
    """Have torch.compile call `benchlib.measure.mark` as Python, between its graphs, instead of tracing it: traced,
    it would guard on whether a timeline is active, so the measured call (a timeline running) would compile
    again. Where this torch has no way to say so, marks are traced (and the measured call may recompile)."""
    from torch._dynamo import trace_rules

    add = getattr(trace_rules, "add", None)
    if add is not None:
        add("benchlib.measure.timeline")


def compile_first_call(call: Callable[[], object], device: str) -> float:
    """Seconds of `call`'s first run, which traces and compiles; its result is dropped. A failure of the
    compiler (no C++ compiler, an op it cannot trace) means the engine does not apply (`NotApplicable`);
    any other error is the code's own and propagates."""
    from benchlib.measure import time_call
    from benchlib.measure.case_child import NotApplicable

    try:
        return time_call(call, device)
    except Exception as error:
        if not compiler_error(error):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise NotApplicable(f"torch.compile could not compile this step: {type(error).__name__}: {first}") from error
