"""One notebook through papermill: the kernel it runs in and how its failure is told.

Shared by the local run loop (`benchlib.runner.execute`) and a grid point on a Dask worker
(`benchlib.runner.sweep`), so the two execute a notebook the same way. It sits below both.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from benchlib.records.store import UNDER_RUNNER_ENV
from benchlib.runner.interrupts import TERMINATING_SIGNALS, Terminated
from benchlib.runner.kernels import kernel_environment

KERNEL_NAME = "python3"
GRACE_S = 15.0  # how long an interrupted kernel may take to save what it measured
LANGUAGE = "python"  # given, so a notebook saved without kernel metadata (nbformat, some editors) runs too
OK, FAILED, TIMED_OUT = "ok", "failed", "timed out"  # how an execution ended


class _CheckedByDeclaration(logging.Filter):
    """papermill warns about every injected name its parameters cell does not assign. A notebook's
    cell holds overrides only; the runner has checked every name against the benchmark's
    declaration, so that warning would be noise on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Passed unknown parameter")


logging.getLogger("papermill").addFilter(_CheckedByDeclaration())


def error_text(error: BaseException) -> str:
    """papermill's execution error as 'ename: evalue' (the notebook's own exception); others by type."""
    ename = getattr(error, "ename", None)
    if ename:
        return f"{ename}: {getattr(error, 'evalue', '')}"
    return f"{type(error).__name__}: {error}"


class _Deadline:
    """Kills the kernels started under it once `timeout_s` has passed. papermill's own timeout is per
    cell and leaves a kernel stuck in C code running; a killed kernel ends the execution at once (its
    records so far are on disk), and the runner reaps what the kernel had started."""

    def __init__(self, kernel_manager_class: type, timeout_s: float | None):
        self.kernels: list[Any] = []
        self.fired = threading.Event()
        kernels = self.kernels

        class Watched(kernel_manager_class):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                kernels.append(self)

        self.kernel_manager_class = Watched
        self.timer = threading.Timer(timeout_s, self._kill) if timeout_s else None

    def _kill(self) -> None:
        self.fired.set()
        for kernel in self.kernels:
            pid = getattr(kernel.provisioner, "pid", None)
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def pass_interrupt_on(self) -> None:
        """Interrupt each kernel still running and wait until it is idle again, at most `GRACE_S`: its cell sees
        the KeyboardInterrupt the runner saw, so a declared benchmark saves the trials that finished
        (`runner.declared`) before the kernel is shut down."""
        import queue

        from jupyter_client import BlockingKernelClient

        for kernel in self.kernels:
            pid = getattr(kernel.provisioner, "pid", None)
            if not pid:
                continue
            client = BlockingKernelClient()
            client.load_connection_info(kernel.get_connection_info())
            client.start_channels(shell=False, stdin=False, hb=False, control=False)
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                client.stop_channels()
                continue
            ends = time.monotonic() + GRACE_S
            try:
                while time.monotonic() < ends:
                    message = client.get_iopub_msg(timeout=max(0.0, ends - time.monotonic()))
                    if (message["msg_type"] == "status" and message["content"].get("execution_state") == "idle"
                            and message["parent_header"].get("msg_type") == "execute_request"):
                        break
            except queue.Empty:
                pass
            finally:
                client.stop_channels()

    def __enter__(self) -> "_Deadline":
        if self.timer:
            self.timer.daemon = True
            self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.timer:
            self.timer.cancel()


@contextmanager
def _interrupts_passed_on(deadline: _Deadline) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP reach the runner only (each kernel runs in a session of its own), and papermill
    shuts the kernel down as the KeyboardInterrupt unwinds it: so, in the main thread, an interrupt is passed on to
    the kernels first (`_Deadline.pass_interrupt_on`), so each saves the trials that finished, then raised here
    (SIGTERM and SIGHUP as `Terminated`, naming the signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops the wait at once
        deadline.pass_interrupt_on()
        # the interrupted cell's task ends with its error unretrieved as papermill unwinds: asyncio would print
        # that traceback at exit, after the run's own summary
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signal.Signals(signum).name)

    numbers = [signal.SIGINT, *(getattr(signal, name) for name in TERMINATING_SIGNALS if hasattr(signal, name))]
    previous = {number: signal.signal(number, interrupted) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def execute_notebook(source: Path | str, output: Path | str, parameters: Mapping[str, Any], *, cwd: Path | str,
                     kernel: Any, kernel_env: Mapping[str, str], output_lines: TextIO | None = None,
                     timeout_s: float | None = None) -> tuple[str, str | None]:
    """Execute `source` into `output` in a `KERNEL_NAME` kernel, with `kernel_env` in the kernel's
    environment, for at most `timeout_s` seconds (None: no limit); what its cells print (stdout and stderr
    alike) goes to `output_lines`. `kernel` is the kernel manager class to start it with, or a kernel already
    started for this notebook (`WarmKernel.take`), used and then shut down. Returns (OK, None) when it ran to
    the end, (TIMED_OUT, what happened) when the limit stopped it, else (FAILED, the error as
    `error_text` tells it); a KeyboardInterrupt (Ctrl-C, or a signal turned into one) is not a
    failure and propagates."""
    import papermill  # here, not at import: it brings nbformat (a second), which planning and refusals need not pay

    started = None if isinstance(kernel, type) else kernel
    deadline = _Deadline(type(started) if started is not None else kernel, timeout_s)
    if started is not None:
        deadline.kernels.append(started)
    try:
        with kernel_environment({**kernel_env, UNDER_RUNNER_ENV: "1"}), deadline, _interrupts_passed_on(deadline):
            papermill.execute_notebook(
                str(source), str(output), parameters=dict(parameters), kernel_name=KERNEL_NAME, language=LANGUAGE,
                progress_bar=False, stdout_file=output_lines, stderr_file=output_lines, cwd=str(cwd),
                kernel_manager_class=deadline.kernel_manager_class,
                shutdown_kernel="immediate",  # its cells have saved all; a graceful exit took 2.6 s more
                **({"km": started} if started is not None else {}))
    except Exception as failure:  # a notebook's failure is a result to record, not to raise
        if deadline.fired.is_set():
            return TIMED_OUT, f"stopped after the --timeout of {timeout_s:g} s ({error_text(failure)})"
        return FAILED, error_text(failure)
    finally:
        if started is not None:  # a kernel papermill did not start, it does not shut down
            shut_down(started)
    return OK, None


def shut_down(kernel: Any) -> None:
    """Kill a started kernel at once and wait for it (its notebook has saved all it measured)."""
    from jupyter_core.utils import run_sync

    if kernel.has_kernel:
        run_sync(kernel.shutdown_kernel)(now=True)


class WarmKernel:
    """The first notebook's kernel, started before the runner checks what it was asked to run, so that the
    kernel's start and its first imports (`imports`: what the notebook's first cells import) overlap the
    check: `benchlib run model.py` spends seconds in its model-file check, in a child process, and a kernel
    seconds starting and importing benchlib and torch. Nothing is measured in either meanwhile. A notebook
    takes it (`take`) only with the same working folder and environment; otherwise, or on a refusal, it is
    shut down (`close`). Where it cannot start (no kernel installed), it is simply not there: the runner's
    own kernel check says why."""

    def __init__(self, cwd: Path, kernel_env: Mapping[str, str], imports: Sequence[str] = ()):
        import tempfile

        from jupyter_core.utils import run_sync

        from benchlib.runner.kernels import ipc_kernel_manager

        self.cwd, self.env = Path(cwd).resolve(), {**kernel_env, UNDER_RUNNER_ENV: "1"}
        self.sockets = tempfile.TemporaryDirectory(prefix="benchlib-kernels-")
        self.kernel: Any = None
        try:
            kernel = ipc_kernel_manager(self.sockets.name)(kernel_name=KERNEL_NAME)
            run_sync(kernel.start_kernel)(cwd=str(self.cwd), env={**self.env, **os.environ},  # the caller's own win
                                          extra_arguments=[f"--IPKernelApp.exec_lines={line}" for line in imports])
            self.kernel = kernel
        except Exception:  # noqa: BLE001 - no kernel to start: the preflight's check_kernel refuses with the reason
            self.sockets.cleanup()

    def take(self, cwd: Path | str, kernel_env: Mapping[str, str]) -> Any:
        """The started kernel for a notebook run in `cwd` with `kernel_env`, once; None (and the kernel shut
        down) for any other."""
        kernel, self.kernel = self.kernel, None
        if kernel is not None and (Path(cwd).resolve(), {**kernel_env, UNDER_RUNNER_ENV: "1"}) != (self.cwd, self.env):
            shut_down(kernel)
            return None
        return kernel

    def close(self) -> None:
        """Shut the kernel down if no notebook took it, and remove its sockets' folder."""
        kernel, self.kernel = self.kernel, None
        if kernel is not None:
            shut_down(kernel)
        self.sockets.cleanup()

    def __enter__(self) -> WarmKernel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
