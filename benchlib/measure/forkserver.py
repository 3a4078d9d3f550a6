"""A warm template process that forks one new process per isolated case.

Every case still runs in a process of its own, whose heap no earlier measurement touched; what the
template saves is Python's start-up and the imports (torch, numpy, pandas, the workload: 1.5-4 s a
case on a 2-core machine, more than most cases measure). The template imports `PRELOAD` and then,
on each request, the target's module when it is benchlib's own (a test's or a user's module is
imported by the child, so an edited file is never served stale); it never runs a tensor operation
and never initialises CUDA, so the fork is safe. The allocator reads MALLOC_* once, at process
start, so each environment gets its own template (`template_for`, at most `KEEP` alive).

`BENCHLIB_ISOLATION=spawn` starts a fresh interpreter per case instead (docs/measuring.md); so does
any request a template cannot serve (it failed to start, or a preload started CUDA).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from importlib import import_module

ISOLATION_ENV = "BENCHLIB_ISOLATION"
FORK, SPAWN = "fork", "spawn"
MODES = (FORK, SPAWN)
PRELOAD = ("torch", "numpy", "benchlib.measure.isolation")
KEEP = 2  # templates alive at once (each holds ~0.4 GB once torch is imported)
START_TIMEOUT_S = 300
# Set per call, not at process start: a template is shared across values of these.
PER_CALL_ENV = frozenset({"PYTEST_CURRENT_TEST", "BENCHLIB_DEADLINE"})


def isolation_mode() -> str:
    """How cases are isolated: `fork` (from a template, the default) or `spawn` (a fresh interpreter)."""
    mode = os.environ.get(ISOLATION_ENV, FORK)
    if mode not in MODES:
        raise ValueError(f"{ISOLATION_ENV}={mode!r}: valid values are {', '.join(MODES)}")
    return mode


class TemplateUnavailable(RuntimeError):
    """The template could not serve a request; the case is run in a fresh interpreter instead."""


class Template:
    """The parent's handle on one template process: JSON lines in, JSON lines out."""

    def __init__(self, env: dict[str, str], warning_filter: str):
        self.process = subprocess.Popen(
            [sys.executable, "-W", warning_filter, "-m", "benchlib.measure.forkserver", str(os.getpid())],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, bufsize=0)
        self.pid = self.process.pid
        self._buffer = b""
        try:
            ready = self._reply(START_TIMEOUT_S)
        except (TimeoutError, TemplateUnavailable) as error:
            self.close()
            raise TemplateUnavailable(f"the template did not start: {error!r}") from error
        if ready.get("ready") is not True:
            self.close()
            raise TemplateUnavailable(f"the template did not start: {ready.get('error', ready)}")

    def _reply(self, timeout_s: float) -> dict:
        """The next line the template wrote (read unbuffered, so `select` never misses a line)."""
        fd = self.process.stdout.fileno()
        end = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            if not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
                raise TimeoutError(f"no answer from the template within {timeout_s:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise TemplateUnavailable("the template process exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, spec_path: str, result_path: str, output_path: str, env: dict[str, str], module: str,
            timeout_s: float) -> tuple[int, bool]:
        """Fork one child for the spec; its exit code (negative: the signal) and whether it timed out.
        A child past `timeout_s` is killed with everything it started (its own session)."""
        request = {"spec": spec_path, "result": result_path, "output": output_path, "env": env,
                   "cwd": os.getcwd(), "module": module}
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            started = self._reply(START_TIMEOUT_S)
        except (OSError, TimeoutError) as error:
            self.close()
            raise TemplateUnavailable(f"the template did not answer: {error!r}") from error
        if "pid" not in started:
            raise TemplateUnavailable(started.get("error", "the template refused the request"))
        child = started["pid"]
        timed_out = False
        try:
            try:
                finished = self._reply(timeout_s)
            except TimeoutError:
                timed_out = True
                _kill_session(child)
                finished = self._reply(START_TIMEOUT_S)
        except BaseException:  # KeyboardInterrupt, a template that died: nothing of the case keeps running
            _kill_session(child)
            self.close()  # its replies are out of step with our requests now
            raise
        _kill_session(child)  # whatever the case left running in its session
        return finished["status"], timed_out

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        _kill_session(self.pid)
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_templates: OrderedDict[tuple, Template] = OrderedDict()


def template_for(env: dict[str, str], warning_filter: str) -> Template:
    """The template for this interpreter, path and start-up environment, started when first needed;
    the least recently used one is closed when more than `KEEP` would be alive."""
    key = (sys.executable, tuple(sys.path), tuple(sorted((k, v) for k, v in env.items() if k not in PER_CALL_ENV)))
    template = _templates.pop(key, None)
    if template is None or not template.alive():
        template = Template(env, warning_filter)
    _templates[key] = template
    while len(_templates) > KEEP:
        _templates.popitem(last=False)[1].close()
    return template


def close_templates() -> None:
    """Stop every template (they also die with this process)."""
    while _templates:
        _templates.popitem()[1].close()


# ---------------------------------------------------------------- template side


def _serve(parent_pid: int) -> None:
    from benchlib.measure import isolation

    isolation.die_with_parent(parent_pid)
    # The protocol keeps private copies of stdin/stdout; what imports print goes nowhere.
    requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    try:
        for name in PRELOAD:
            import_module(name)
    except Exception as error:  # noqa: BLE001 - said to the parent, which spawns instead
        replies.write(json.dumps({"ready": False, "error": f"{type(error).__name__}: {error}"}) + "\n")
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in requests:
        request = json.loads(line)
        module = request["module"]
        if module.split(".")[0] == "benchlib" and module not in sys.modules:
            try:
                import_module(module)
            except Exception:  # noqa: BLE001 - the child imports it again and reports the error
                pass
        if _cuda_initialized():
            replies.write(json.dumps({"error": f"importing {module} initialised CUDA; a template that "
                                      "did cannot fork"}) + "\n")
            continue
        code_pages = _mapped_code_pages()
        pid = os.fork()
        if pid == 0:
            _map_again(code_pages)
            del code_pages
            _child(request, requests, replies, devnull)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _mapped_code_pages() -> list:
    """(start, page offsets) of the pages of read-only file mappings (code, constants) this process has
    mapped. Fork does not copy those page-table entries: the child would fault the pages back in during
    its measured calls and count them in its resident set, which a fresh interpreter counted at import."""
    import numpy as np

    regions = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and fields[1][0] == "r" and fields[1][1] != "w":
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                regions.append((start, end))
    pages = []
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for start, end in regions:
            entries = np.frombuffer(os.pread(pagemap, (end - start) // PAGE * 8, start // PAGE * 8), dtype=np.uint64)
            present = np.flatnonzero(entries >> np.uint64(63))
            if present.size:
                pages.append((start, end, present))
    finally:
        os.close(pagemap)
    return pages


def _map_again(pages: list) -> None:
    """Read one byte of each page `_mapped_code_pages` listed, so the child starts with the mapped set a
    fresh interpreter would have had after the same imports."""
    import ctypes

    import numpy as np

    for start, end, present in pages:
        memory = np.frombuffer((ctypes.c_char * (end - start)).from_address(start), dtype=np.uint8)
        int(memory[present * PAGE].sum())


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _child(request: dict, requests, replies, devnull: int) -> None:
    """The forked child: its own session, output file and environment, then the case."""
    status = 1
    try:
        os.setsid()
        requests.close()
        replies.close()
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(devnull, 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from benchlib.measure.isolation import child_main

        status = child_main(request["spec"], request["result"])
    except BaseException:  # noqa: BLE001 - a child must never return into the template's loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
