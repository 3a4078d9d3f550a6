"""SIGTERM and SIGHUP (a CI job's time-out, a cancelled job, a closed terminal) handled like Ctrl-C, for
the whole of a `benchlib` command: planning included, so a run stopped while it checks a model file
still ends with its message and exit status 130 (docs/setup.md, "Exit status"), not the shell's 143."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

TERMINATING_SIGNALS = ("SIGTERM", "SIGHUP")


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C; `signal_name` says which."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the run lasts, SIGTERM and SIGHUP raise Terminated (a KeyboardInterrupt) in the main thread."""
    def raise_terminated(signum, _frame):
        raise Terminated(signal.Signals(signum).name)

    previous = {}
    for name in TERMINATING_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            try:
                previous[number] = signal.signal(number, raise_terminated)
            except ValueError:  # not the main thread: signals stay as they were
                pass
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
