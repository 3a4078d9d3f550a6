"""A warm template process that forks one new process per isolated case.

Every case still runs in a process of its own, whose heap no earlier measurement touched; what the
template saves is Python's start-up and the imports (numpy, pandas, the workload, torch where the
case uses it: 1.5-4 s a case on a 2-core machine, more than most cases measure). A template imports
`PRELOAD` and the case's own `preload` (torch for a torch engine: what its set-up would import
anyway, so a numpy engine's process holds no torch objects for its collector to walk), and, on each
request, the target's module when it is benchlib's own (a test's or a user's module is imported by
the child, so an edited file is never served stale). It never runs a tensor operation and never
initialises CUDA, so the fork is safe. A preload in `LAZY_IMPORTS` is one a process makes during its
first step, not at start-up; the child of a template that holds one takes every page it inherited as
its own before its case (`_own_inherited_pages`), so its measured calls never wait on a copy-on-write
fault that a process which had imported the module itself would not have taken. The allocator reads
MALLOC_* once, at process start, so each environment gets its own template (`run_in_template`, at most
`KEEP` alive).

`BENCHLIB_ISOLATION=spawn` starts a fresh interpreter per case instead (docs/measuring.md); so does
any request a template cannot serve (it failed to start, or an import started CUDA).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from importlib import import_module

from benchlib.errors import Refused

ISOLATION_ENV = "BENCHLIB_ISOLATION"
FORK, SPAWN = "fork", "spawn"
MODES = (FORK, SPAWN)
PRELOAD = ("numpy", "benchlib.measure.case_child")  # what every isolated child imports before its case
KEEP = 3  # templates alive at once (one holds ~0.4 GB once torch is imported)
START_TIMEOUT_S = 300
# Set per call, not at process start: a template is shared across values of these. TORCHINDUCTOR_CACHE_DIR is
# set by torch itself in whichever process imports its compiler (the template too, to the same default).
PER_CALL_ENV = frozenset({"PYTEST_CURRENT_TEST", "BENCHLIB_DEADLINE", "TORCHINDUCTOR_CACHE_DIR"})
# A forked child must re-map its template's code pages (`_mapped_code_pages`): without /proc's pagemap it could not.
FORK_SUPPORTED = hasattr(os, "fork") and os.path.exists("/proc/self/pagemap")
# Imported on first use, during a step: torch.optim, torch.func, checkpoint and the compiler import the dynamo
# stack (0.8 s on a 2-core machine). Preloaded, they leave the child 50,000 pages it shares with the template;
# steps that wrote to them one by one were 6% slower over their first 200 calls (docs/measuring.md).
LAZY_IMPORTS = frozenset({"torch._dynamo"})
MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14): fault a range in writable, copying what is shared
PAGEMAP_CHUNK = 8192  # pages per pagemap read: 64 KiB buffers, below glibc's mmap threshold, so the
# template's own scan cannot raise the dynamic threshold its children inherit (glibc-default policy)


def isolation_mode() -> str:
    """How cases are isolated: `fork` (from a template, the default where the kernel shows a process's
    mapped pages, i.e. Linux) or `spawn` (a fresh interpreter; the default elsewhere)."""
    mode = os.environ.get(ISOLATION_ENV, FORK)
    if mode not in MODES:
        raise Refused(f"{ISOLATION_ENV}={mode!r}: valid values are {', '.join(MODES)}")
    return mode if FORK_SUPPORTED else SPAWN


class TemplateUnavailable(RuntimeError):
    """The template could not serve a request; the case is run in a fresh interpreter instead."""


class TemplateRefused(TemplateUnavailable):
    """The template cannot fork at all (an import initialised CUDA): later cases spawn at once."""


class Template:
    """The parent's handle on one template process: JSON lines in, JSON lines out."""

    def __init__(self, env: dict[str, str], warning_filter: str, preload: tuple[str, ...]):
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-W", warning_filter, "-m", "benchlib.measure.forkserver", str(os.getpid()), *preload],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            start_new_session=True, bufsize=0)
        self.pid = self.process.pid
        self._buffer = b""
        self.ready = False

    def wait_ready(self) -> None:
        """Wait until the template has imported what it preloads (it started doing so when made)."""
        if self.ready:
            return
        try:
            ready = self._reply(START_TIMEOUT_S)
        except (TimeoutError, TemplateUnavailable) as error:
            self.close()
            raise TemplateUnavailable(f"the template did not start: {error}{self._said()}") from None
        if ready.get("ready") is not True:
            self.close()
            raise TemplateUnavailable(f"the template did not start: {ready.get('error', ready)}")
        self.ready = True

    def _said(self) -> str:
        """The end of what the template wrote to stderr, for a message."""
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return f" ({text[-500:]})" if text else ""

    def _reply(self, timeout_s: float) -> dict:
        """The next line the template wrote (read unbuffered, so `select` never misses a line)."""
        fd = self.process.stdout.fileno()
        end = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            if not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
                raise TimeoutError(f"no answer from the template within {timeout_s:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise TemplateUnavailable(f"the template process exited{self._said()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, spec_path: str, result_path: str, output_path: str, env: dict[str, str], module: str,
            timeout_s: float) -> tuple[int, bool]:
        """Fork one child for the spec; its exit code (negative: the signal) and whether it timed out.
        A child past `timeout_s` is killed with everything it started (its own session). Anything that
        interrupts the exchange (Ctrl-C, a template that dies) closes the template: its replies would be
        out of step with the next request's."""
        request = {"spec": spec_path, "result": result_path, "output": output_path, "env": env,
                   "cwd": os.getcwd(), "module": module}
        child = None
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            started = self._reply(START_TIMEOUT_S)
            if "pid" not in started:
                raise TemplateRefused(started.get("error", "the template refused the request"))
            child = started["pid"]
            try:
                finished = self._reply(timeout_s)
                timed_out = False
            except TimeoutError:
                timed_out = True
                _kill_session(child)
                finished = self._reply(START_TIMEOUT_S)
        except (OSError, TimeoutError) as error:
            _kill_session(child)
            self.close()
            raise TemplateUnavailable(f"the template did not answer: {error}") from None
        except BaseException:
            _kill_session(child)
            self.close()
            raise
        _kill_session(child)  # whatever the case left running in its session
        return finished["status"], timed_out

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        _kill_session(self.pid)
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self._stderr):
            stream.close()


def _kill_session(pid: int | None) -> None:
    """Kill `pid`'s session (it leads one: the template, a case child), and `pid` itself should it not
    lead one yet."""
    if pid is None:
        return
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


_templates: OrderedDict[tuple, Template] = OrderedDict()
_failed: dict[tuple, str] = {}  # why a template could not start, so later cases spawn at once
_lock = threading.Lock()  # one exchange with the templates at a time, whichever thread asks
if FORK_SUPPORTED:
    os.register_at_fork(after_in_child=lambda: (_templates.clear(), _failed.clear()))  # a forked copy owns none


def _key(env: dict[str, str], preload: tuple[str, ...]) -> tuple:
    """What a template is started with: its interpreter, working directory (the first entry of its import path),
    preload and start-up environment. Not this process's sys.path: a child extends its own from the spec."""
    return (sys.executable, os.getcwd(), tuple(preload),
            tuple(sorted((k, v) for k, v in env.items() if k not in PER_CALL_ENV)))


def _template(key: tuple, env: dict[str, str], warning_filter: str, preload: tuple[str, ...]) -> Template:
    """The live template for `key`, started now if there is none (not waited for), as the most recently used;
    the least recently used is closed when more than `KEEP` would be alive. Called with `_lock` held."""
    template = _templates.pop(key, None)
    if template is None or not template.alive():
        template = Template(env, warning_filter, preload)
    _templates[key] = template
    while len(_templates) > KEEP:
        _templates.popitem(last=False)[1].close()
    return template


def start_template(env: dict[str, str], warning_filter: str, preload: tuple[str, ...]) -> None:
    """Start the template `run_in_template` would use for these, without waiting for it: its imports then
    overlap the caller's own work (a model file's import, planning) instead of delaying the first case."""
    key = _key(env, preload)
    with _lock:
        if key not in _failed:
            try:
                _template(key, env, warning_filter, preload)
            except OSError:  # it could not even be started: the first case says so, or spawns
                pass


def run_in_template(env: dict[str, str], warning_filter: str, preload: tuple[str, ...], spec_path: str,
                    result_path: str, output_path: str, module: str, timeout_s: float) -> tuple[int, bool]:
    """Run the spec in a child of the template for this interpreter, path, start-up environment and
    preload, starting that template when first needed (the least recently used one is closed when
    more than `KEEP` would be alive). TemplateUnavailable: run it some other way."""
    key = _key(env, preload)
    with _lock:
        if key in _failed:
            raise TemplateUnavailable(_failed[key])
        template = _template(key, env, warning_filter, preload)
        try:
            template.wait_ready()
        except TemplateUnavailable as error:
            _templates.pop(key, None)
            _failed[key] = str(error)
            raise
        try:
            return template.run(spec_path, result_path, output_path, env, module, timeout_s)
        except TemplateRefused as error:
            _failed[key] = str(error)
            raise


# ---------------------------------------------------------------- template side


def _serve(parent_pid: int, preload: list[str]) -> None:
    from benchlib.measure import case_child

    case_child.die_with_parent(parent_pid)
    # The protocol keeps private copies of stdin/stdout; what imports print goes nowhere.
    requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if not _can_own_pages():  # the children import them themselves, as a fresh interpreter would
        preload = [name for name in preload if name not in LAZY_IMPORTS]
    own_pages = any(name in LAZY_IMPORTS for name in preload)
    try:
        for name in (*PRELOAD, *preload):
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
            return
        code_pages = _mapped_code_pages()
        template = os.getpid()
        pid = os.fork()
        if pid == 0:
            case_child.die_with_parent(template)
            _child(request, requests, replies, devnull, code_pages, own_pages)
        del code_pages
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _mapped_code_pages() -> list:
    """(chunk start, page offsets) of the pages of read-only file mappings (code, constants) this
    process has mapped. Fork does not copy those page-table entries: the child would fault the pages
    back in during its measured calls and count them in its resident set, which a fresh interpreter
    counted at import. Read in `PAGEMAP_CHUNK`s, so no buffer here is large enough to be mmapped."""
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
            for chunk in range(start, end, PAGEMAP_CHUNK * PAGE):
                count = min(PAGEMAP_CHUNK, (end - chunk) // PAGE)
                entries = np.frombuffer(os.pread(pagemap, count * 8, chunk // PAGE * 8), dtype=np.uint64)
                present = np.flatnonzero(entries >> np.uint64(63))
                if present.size:
                    pages.append((chunk, count, present))
    finally:
        os.close(pagemap)
    return pages


def _map_again(pages: list) -> None:
    """Read one byte of each page `_mapped_code_pages` listed, so the child starts with the mapped set a
    fresh interpreter would have had after the same imports."""
    import ctypes

    import numpy as np

    for chunk, count, present in pages:
        memory = np.frombuffer((ctypes.c_char * (count * PAGE)).from_address(chunk), dtype=np.uint8)
        int(memory[present * PAGE].sum())


def _madvise():
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def _can_own_pages() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE, which `_own_inherited_pages` needs."""
    import ctypes

    buffer = ctypes.create_string_buffer(2 * PAGE)
    page = -(-ctypes.addressof(buffer) // PAGE) * PAGE  # the first page boundary inside it
    return _madvise()(page, PAGE, MADV_POPULATE_WRITE) == 0


def _own_inherited_pages() -> None:
    """Copy every present page of this process's private writable mappings that it still shares with its
    template, in runs of adjacent pages, one system call each (about 0.1 s for a template holding torch and
    its dynamo stack). Pages never touched stay unmapped, so the resident set grows only by those the
    template read and never wrote (within 1% of a fresh interpreter's, tests/test_forkserver.py); a run
    unmapped since the scan is refused by the kernel, never written."""
    import numpy as np

    runs = []
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        with open("/proc/self/maps") as maps:
            regions = [line.split(maxsplit=5) for line in maps]
        for fields in regions:
            if fields[1] != "rw-p":
                continue
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            for chunk in range(start, end, PAGEMAP_CHUNK * PAGE):
                count = min(PAGEMAP_CHUNK, (end - chunk) // PAGE)
                entries = np.frombuffer(os.pread(pagemap, count * 8, chunk // PAGE * 8), dtype=np.uint64)
                shared = ((entries >> np.uint64(63)) & ~(entries >> np.uint64(56)) & np.uint64(1)).astype(np.int8)
                edges = np.diff(np.concatenate(([0], shared, [0])))
                runs += [(chunk + first * PAGE, (last - first) * PAGE)
                         for first, last in zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist())]
    finally:
        os.close(pagemap)
    madvise = _madvise()
    for address, length in runs:
        madvise(address, length, MADV_POPULATE_WRITE)


def _start_blas_threads() -> None:
    """One small threaded product, so NumPy's BLAS has its worker threads again, as it has after import
    in a fresh interpreter (OpenBLAS stops them before a fork and starts them at the next threaded call,
    which would otherwise be a numpy engine's measured one). 100x100 is above OpenBLAS's threading
    threshold, and its arrays stay below glibc's mmap threshold."""
    import numpy as np

    block = np.ones((100, 100))
    block @ block


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _child(request: dict, requests, replies, devnull: int, code_pages: list, own_pages: bool) -> None:
    """The forked child: its own session first (so a timeout's kill reaches it), then the pages (mapped and,
    with `own_pages`, its own), the output file, working directory, import path and environment a fresh
    interpreter would have had, then the case."""
    status = 1
    try:
        os.setsid()
        from benchlib.measure.case_child import child_main, name_process  # imported by the template already

        name_process()
        requests.close()
        replies.close()
        _map_again(code_pages)
        if own_pages:
            _own_inherited_pages()
        _start_blas_threads()
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(devnull, 0)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        status = child_main(request["spec"], request["result"])
    except BaseException:  # noqa: BLE001 - a child must never return into the template's loop
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2:])
