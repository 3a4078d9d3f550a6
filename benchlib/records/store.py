"""Run directories: atomic writes of records, tables and run.json, and loading runs back.

A run directory holds `run.json`, `records.parquet` (every benchmark's rows),
`records/<benchmark>.parquet`, `figures/`, `tables/` and, under the runner, `notebooks/`. Each
file is written to a temporary name in the same directory and renamed, so a crash or Ctrl-C leaves
the previous version or the new one, never half a file. Parquet and JSON only: no pickle.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from benchlib.errors import Refused
from benchlib.records.environment import capture_environment
from benchlib.records.places import RUN_INFO, default_results_root, find_project_root, now_iso
from benchlib.records.schema import (RECORD_COLUMNS, SCHEMA_VERSION, SCHEMA_VERSION_KEY, RecordError, arrow_schema,
                                      conform, empty_records_frame, records_frame, upgrade_frame)

RECORDS = "records.parquet"
CUDA_SNAPSHOT_FOLDER = "cuda_snapshots"  # a run's CUDA allocator snapshots (benchlib.measure.cuda_snapshot)
FIGURES = "figures"  # a run's figure files (`benchlib.report.figure_files`)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def file_name(name: Any, what: str) -> str:
    """`name`, where it can name a file in a run directory (letters, digits, '_', '-', '.'); else ValueError."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name):
        raise Refused(f"{what} name must be letters, digits, '_', '-', '.' (it names a file), got {name!r}")
    return name


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files readable by the owner only; results files get the usual permissions.
_FILE_MODE = 0o666 & ~_current_umask()


OPENED_BY_NOTEBOOK = "Run.open"  # run.json's `created_by` for a run a notebook made itself (no runner)
# Set in every kernel the runner starts: a run.json such a kernel's Run.open writes (a grid point's) is the runner's.
UNDER_RUNNER_ENV = "BENCHLIB_UNDER_RUNNER"


def write_atomic(path: Path, write: Any, make_folder: bool = True) -> Path:
    """Call `write(temp_path)`, then rename over `path`; on any error the old file stays and no temp is left.
    An OSError (a full disk, a directory where the file should be, no permission, a folder that is gone where
    `make_folder` is false) names `path`, the file the user knows, rather than the temporary one or none."""
    path = Path(path)
    temp_name = None
    try:
        if make_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(descriptor)
        write(temp_name)
        os.chmod(temp_name, _FILE_MODE)
        with open(temp_name, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temp_name, path)
    except BaseException as error:
        if temp_name is not None:
            Path(temp_name).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(error.errno, f"cannot write: {error.strerror or error}", str(path)) from error
        raise
    return path


def write_parquet_atomic(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write `df` to parquet at `path` via a temp file in the same directory and `os.replace`."""
    return write_atomic(Path(path), lambda temp: df.to_parquet(temp, index=False))


def write_records_atomic(frame: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write tidy records with the records' pyarrow schema (schema_version in the file's metadata)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(conform(frame), schema=arrow_schema(), preserve_index=False)

    def write_and_verify(temp: str) -> None:  # a short or unreadable new file never replaces the old one
        pq.write_table(table, temp)
        if pq.read_metadata(temp).num_rows != table.num_rows:
            raise OSError(f"the new file does not read back {table.num_rows} rows; the old one is kept")

    return write_atomic(Path(path), write_and_verify)


def rows_held(path: Path) -> int:
    """How many rows a parquet file holds (0 when it is missing or unreadable, so a broken file can be rebuilt)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # missing, truncated, not parquet: nothing worth keeping
        return 0


def write_text_atomic(text: str, path: str | os.PathLike, make_folder: bool = True) -> Path:
    """Write text (UTF-8) atomically; without `make_folder`, only into a folder that exists (a run's, which
    something else may have deleted meanwhile: never made again holding this file alone)."""
    return write_atomic(Path(path), lambda temp: Path(temp).write_text(text, encoding="utf-8"), make_folder)


def write_json_atomic(data: Any, path: str | os.PathLike) -> Path:
    """Write JSON atomically (indented, so run.json reads well in a diff)."""
    return write_text_atomic(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n", path)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def new_run_dir(root: str | os.PathLike, device: Any = "cpu", when: datetime | None = None) -> Path:
    """Create `<root>/<run-id>/`, run-id = UTC timestamp, host and device; suffixed when taken."""
    device_name = getattr(device, "name", device) or "cpu"
    stamp = (when or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{_slug(socket.gethostname().split('.')[0])}-{_slug(str(device_name))}"
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        candidate = root / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"could not find a free run directory name for {base} in {root}")


class Run:
    """One run directory; notebooks write their records and figures through it."""

    def __init__(self, path: Path, info: dict[str, Any]):
        self.path = Path(path)
        self.info = info

    @property
    def run_id(self) -> str:
        return self.info["run_id"]

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @classmethod
    def create(
        cls,
        root: str | os.PathLike | None = None,
        device: Any = "cpu",
        *,
        allocator_policy: str | None = None,
        **info: Any,
    ) -> Run:
        """A new run directory under `root` with a run.json of this environment (plus `info`)."""
        path = new_run_dir(default_results_root() if root is None else root, device)
        return cls._start(path, path.name, device, allocator_policy, info)

    @classmethod
    def _start(cls, path: Path, run_id: str, device: Any, allocator_policy: str | None, info: dict) -> Run:
        """A run in `path` with a fresh run.json: identity, start time, `info`, the environment."""
        run = cls(
            path,
            {
                "run_id": run_id,
                "schema_version": SCHEMA_VERSION,
                "started_at": now_iso(),
                "ended_at": None,
                "device": getattr(device, "name", device),
                **info,
                "environment": capture_environment(device, allocator_policy=allocator_policy),
                "notebooks": {},
            },
        )
        run.write_info()
        return run

    @classmethod
    def open(cls, results_dir: str | os.PathLike = "", device: Any = "cpu", *, config: Any = None) -> Run:
        """The run directory a notebook writes into: `results_dir` from the runner, or a new one when empty.

        An existing run.json belongs to whoever created it (the runner): opening does not rewrite it.
        A run opened here (JupyterLab, or papermill without the runner) names this kernel as its runner,
        so `benchlib runs` says `running` while it lives, and `config`'s benchmark as its notebook,
        `running` until `benchlib.runner.interactive.finish_notebook` ends the run.
        """
        path = Path(results_dir) if results_dir else None
        if path is not None and (path / RUN_INFO).is_file():
            return cls(path, json.loads((path / RUN_INFO).read_text(encoding="utf-8")))
        opened = ({"created_by": "benchlib run"} if os.environ.get(UNDER_RUNNER_ENV) else
                  {"created_by": OPENED_BY_NOTEBOOK, "runner": {"pid": os.getpid(), "host": socket.gethostname()}})
        if path is None:
            run = cls.create(device=device, **opened)
        else:
            if path.exists() and not path.is_dir():
                raise NotADirectoryError(f"results_dir {str(path)!r} is a file; give a directory (or '' for a new run)")
            path.mkdir(parents=True, exist_ok=True)
            run = cls._start(path, path.resolve().name, device, None, opened)
        if config is not None:
            if getattr(config, "at_quick_values", False):
                run.info["quick"] = True  # the report says so, and judges its verdicts as a first look
            run.record_notebook(config.benchmark, status="running", started_at=run.info["started_at"],
                                parameters=config.plain())
        return run

    def write_info(self) -> Path:
        """Write run.json atomically from `self.info`."""
        return write_json_atomic(self.info, self.path / RUN_INFO)

    def record_notebook(self, name: str, **entry: Any) -> None:
        """Merge `entry` (status, duration_s, error, parameters...) into run.json's notebook `name`."""
        self.info.setdefault("notebooks", {}).setdefault(name, {}).update(entry)
        self.write_info()

    def finish(self, **info: Any) -> None:
        """Stamp the end time (and any final fields) into run.json."""
        self.info.update(info, ended_at=now_iso())
        self.write_info()

    def save_records(self, records: Iterable[Mapping[str, Any]] | pd.DataFrame, benchmark: str) -> pd.DataFrame:
        """Write `records/<benchmark>.parquet` (run_id filled in) and refresh the merged `records.parquet`."""
        if not isinstance(benchmark, str) or not _SAFE_NAME.match(benchmark):
            raise ValueError(
                f"benchmark must be a name of letters, digits, '_', '-', '.' (it names a file), got {benchmark!r}"
            )
        frame = records_frame(records)
        if frame.empty:
            raise ValueError(f"no records to save for {benchmark!r}: a benchmark that measured nothing is a bug")
        others = sorted(set(frame["benchmark"]) - {benchmark})
        if others:
            raise ValueError(
                f"save_records(..., benchmark={benchmark!r}) got rows of benchmark(s) {', '.join(others)}; "
                "save each benchmark's rows under its own name"
            )
        frame["run_id"] = self.run_id
        fragment = self.path / "records" / f"{benchmark}.parquet"
        replaced = rows_held(fragment)
        write_records_atomic(frame, fragment)
        self.refresh_records(replaced=replaced)
        return frame

    def refresh_records(self, *, skip_unreadable: bool = False, replaced: int = 0) -> list[str]:
        """Rebuild `records.parquet` from every `records/*.parquet` (`benchlib merge-records` after a crash).

        An unreadable fragment raises RecordsUnreadable naming it; with `skip_unreadable` the
        others are merged and the unreadable ones returned (one message each). records.parquet is
        never replaced by fewer rows than it holds, less the `replaced` rows of a fragment the
        caller just rewrote: RecordsKept then, the old file untouched.
        """
        parts, skipped = [], []
        for part in sorted((self.path / "records").glob("*.parquet")):
            try:
                parts.append(read_records_file(part))
            except RecordsUnreadable as error:
                if not skip_unreadable:
                    raise
                skipped.append(str(error))
        merged = pd.concat(parts, ignore_index=True) if parts else empty_records_frame()
        held = rows_held(self.path / RECORDS)
        if len(merged) < held - replaced:
            raise RecordsKept(f"{self.path / RECORDS} kept: it holds {held} rows, {self.path / 'records'} "
                              f"gives {len(merged)}" + (f" ({len(skipped)} file(s) unreadable)" if skipped else ""),
                              skipped)
        write_records_atomic(merged, self.path / RECORDS)
        return skipped

    def save_table(self, df: pd.DataFrame, name: str) -> Path:
        """`tables/<name>.parquet`: a table that is not tidy records (e.g. memory timeline samples), atomically."""
        file_name(name, "table")
        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"save_table takes a pandas DataFrame, got {type(df).__name__}")
        return write_parquet_atomic(df, self.path / "tables" / f"{name}.parquet")

    def load_records(self) -> pd.DataFrame:
        return load_records(self.path)


LATEST = "latest"  # the run name resolve_run reads as the newest run under the root


def resolve_run(run: str | os.PathLike | Run, root: str | os.PathLike | None = None) -> Path:
    """A run directory from a Run, a path, or a run_id under `root` (default results root); `latest` is
    the newest run there (run ids begin with their start time), for scripts such as a CI job."""
    if isinstance(run, Run):
        return run.path
    try:
        return _resolve_run(run, root)
    except OSError as error:  # a name the file system refuses (too long, a loop): no run of that name
        if isinstance(error, FileNotFoundError):
            raise
        raise FileNotFoundError(f"no run {str(run)[:80]!r}{'...' if len(str(run)) > 80 else ''}: "
                                f"{error.strerror or error}") from None


def _resolve_run(run: str | os.PathLike, root: str | os.PathLike | None) -> Path:
    path = Path(run)
    if (path / RUN_INFO).is_file() or (path / RECORDS).is_file():
        return path
    _refuse_unreadable_run(path)
    root = default_results_root() if root is None else Path(root)
    if str(run) == LATEST:
        runs = sorted(info.parent for info in root.glob(f"*/{RUN_INFO}"))
        if not runs:
            raise FileNotFoundError(f"no run 'latest': no runs in {root}")
        return runs[-1]
    if (root / str(run) / RUN_INFO).is_file():
        return root / str(run)
    _refuse_unreadable_run(root / str(run))
    known = sorted(info.parent.name for info in root.glob(f"*/{RUN_INFO}"))
    hint = f"known runs in {root}: {', '.join(known[-10:])}" if known else f"no runs in {root}"
    raise FileNotFoundError(f"no run {str(run)!r} (not a run directory, nor a run_id under {root}); {hint}")


def _refuse_unreadable_run(path: Path) -> None:
    """A run's file that is there but is no regular file (a FIFO, a directory): RecordsUnreadable naming
    it, rather than "no run" (or a read that blocks on a pipe for ever)."""
    for name in (RUN_INFO, RECORDS):
        entry = path / name
        if path.is_dir() and entry.exists() and not entry.is_file():
            raise RecordsUnreadable(f"{entry} is {_kind(entry)}, not a file: the run's {name} cannot be read")


def _kind(path: Path) -> str:
    """What a path that is not a regular file is, in words."""
    import stat

    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((words for test, words in kinds if test(mode)), "not a regular file")


class RecordsUnreadable(Refused):
    """A records or run.json file that exists but cannot be read; the message names the file."""


class RecordsKept(Refused):
    """records.parquet was not rebuilt: the per-notebook files would give fewer rows than it holds."""

    def __init__(self, message: str, skipped: list[str]):
        super().__init__(message)
        self.skipped = skipped  # the unreadable fragments, one message each


def schema_version_of(path: Path) -> int:
    """The records schema version a parquet file was written with. An unstamped file is version 1 (written before
    versions were stamped), unless its columns are today's (a table written by other code than benchlib's writer)."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    stamped = (schema.metadata or {}).get(SCHEMA_VERSION_KEY.encode())
    if stamped is not None:
        return int(stamped)
    return SCHEMA_VERSION if set(RECORD_COLUMNS) <= set(schema.names) and "engine" not in schema.names else 1


def read_records_file(path: Path) -> pd.DataFrame:
    """One parquet file of records (any readable schema version) in today's schema; RecordsUnreadable
    names the file and why otherwise."""
    if not path.is_file():  # pyarrow would read a directory as a dataset, or say nothing of the name
        raise RecordsUnreadable(f"{path}: not a file ({_kind(path) if path.exists() else 'missing'}); records are "
                                "one parquet file")
    try:
        return conform(upgrade_frame(pd.read_parquet(path), schema_version_of(path)))
    except RecordError as error:
        raise RecordsUnreadable(f"{path}: {error}") from None
    except Exception as error:  # pyarrow raises OSError, ArrowInvalid...; the caller needs the file's name
        raise RecordsUnreadable(f"{path}: cannot read records ({type(error).__name__}: {error}); "
                                f"`benchlib merge-records {path.parent if path.name == RECORDS else path.parent.parent}` "
                                "rebuilds records.parquet from the per-notebook files") from None


def load_run_info(run: str | os.PathLike | Run, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """run.json of a run (run_id or path)."""
    path = resolve_run(run, root) / RUN_INFO
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the run directory has no run.json")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecordsUnreadable(f"{path}: cannot read run.json ({type(error).__name__}: {error})") from None
    if not isinstance(info, dict):
        raise RecordsUnreadable(f"{path}: run.json holds a JSON {type(info).__name__}, not an object of the run's "
                                "facts (run_id, environment, notebooks...)")
    return info


def refuse_overwriting_run_data(path: str | os.PathLike, page: str) -> Path:
    """`path`, where a command is about to write its page named `page` (history.html); a `ValueError`
    (exit 2) when it is a directory, or an existing file inside a run other than such a page (run.json,
    records, a report), so no command replaces a run's data."""
    path = Path(path)
    if path.is_dir():
        raise Refused(f"{path} is a directory; give the page's file name (e.g. {path / page})")
    in_run = next((parent for parent in list(path.parents)[:3] if (parent / RUN_INFO).is_file()), None)
    if path.exists() and path.name != page and in_run is not None:
        raise Refused(f"{path} is a file of the run {in_run}; writing the page there would replace its data "
                      f"(give another path, e.g. {path.parent / page})")
    return path


def load_records(run: str | os.PathLike | Run, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """records.parquet of a run (run_id or path), with the schema's columns and dtypes."""
    path = resolve_run(run, root) / RECORDS
    if not path.exists():
        return empty_records_frame()
    return read_records_file(path)


REFERENCE_DIR = Path("results") / "reference"  # committed reference runs, under the project root


def reference_records(benchmark: str, project: Path | None = None,
                      device: str | None = None) -> tuple[str, pd.DataFrame] | None:
    """(run_id, records of `benchmark`) from the newest committed reference run that holds them
    (`results/reference/<run-id>/` of the project), or None: notebooks compare with measured
    reference figures, never with numbers typed in. With `device` ("cpu", "cuda:0"...), only runs on
    that kind of device count: a CPU run's ratios are no reference for a GPU's."""
    project = project or find_project_root() or find_project_root(Path(__file__).resolve().parent)
    if project is None:
        return None
    kind = None if device is None else str(device).split(":")[0]
    for info_path in sorted((project / REFERENCE_DIR).glob(f"*/{RUN_INFO}"), reverse=True):
        if kind is not None and str(load_run_info(info_path.parent).get("device", "")).split(":")[0] != kind:
            continue
        records = load_records(info_path.parent)
        rows = records[records["benchmark"] == benchmark]
        if not rows.empty:
            return info_path.parent.name, rows.reset_index(drop=True)
    return None


RUN_MARKERS = (RUN_INFO, RECORDS, "records", "notebooks")  # what makes a directory a run's
RUN_FACTS = {"run_id": str, "started_at": str, "environment": dict, "notebooks": dict}  # every run.json holds them


def _runner_alive(info: Mapping[str, Any]) -> bool | None:
    """Whether the runner that wrote run.json still runs (None: not recorded, or another host)."""
    runner = info.get("runner") or {}
    if not runner.get("pid") or runner.get("host") != socket.gethostname():
        return None
    import psutil

    return psutil.pid_exists(int(runner["pid"]))


def run_state(info: Mapping[str, Any]) -> str:
    """finished, interrupted, running, or stale (run.json says running but its runner is gone)."""
    if info.get("ended_at"):
        return "interrupted" if info.get("interrupted") else "finished"
    alive = _runner_alive(info)
    if alive is False:
        return "stale: runner gone"
    return "running" if alive else "not finished"


def list_runs(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """One row per run directory under `root`: id, state, times, device, host, commit, notebook, failure
    and record counts, and `problem` for a run whose files cannot be read (listed, never skipped)."""
    root = default_results_root() if root is None else Path(root)
    if not Path(root).is_dir():
        raise FileNotFoundError(f"no results directory {str(root)!r}")
    rows = []
    for directory in sorted(path for path in Path(root).iterdir() if path.is_dir() and not path.name.startswith(".")):
        if not any((directory / marker).exists() or (directory / marker).is_symlink() for marker in RUN_MARKERS):
            continue  # (a dangling or looping link is still a run's file: listed with its problem, never hidden)
        row = {"run_id": directory.name, "state": "", "started_at": None, "ended_at": None, "device": None,
               "host": None, "git_commit": None, "notebooks": 0, "failed": 0, "records": 0, "problem": "",
               "path": str(directory)}
        problems = []
        try:
            if (directory / RUN_INFO).is_symlink() and not (directory / RUN_INFO).exists():
                raise RecordsUnreadable(f"{RUN_INFO} is a link that leads nowhere (dangling, or a loop)")
            info = load_run_info(directory, root)
        except (FileNotFoundError, RecordsUnreadable) as error:
            problems.append(str(error).replace(str(directory) + os.sep, ""))
            info = {}
        lacking = [key for key, kind in RUN_FACTS.items() if info and not isinstance(info.get(key), kind)]
        if lacking:
            problems.append(f"{RUN_INFO} lacks {', '.join(lacking)} (or holds them in the wrong shape)")
            info = {key: value for key, value in info.items() if key not in lacking}
        environment = info.get("environment", {})
        notebooks = info.get("notebooks", {})
        git = environment.get("git") if isinstance(environment.get("git"), dict) else {}
        row.update(
            run_id=info.get("run_id", directory.name),
            state="incomplete" if lacking else run_state(info) if info else "unreadable",
            started_at=info.get("started_at"), ended_at=info.get("ended_at"), device=info.get("device"),
            host=environment.get("host"), git_commit=str(git.get("commit") or "")[:12] or None,
            notebooks=len(notebooks),
            failed=sum(1 for entry in notebooks.values()
                       if isinstance(entry, dict) and entry.get("status") in ("failed", "partial", "timed out", "interrupted")),
        )
        records_path = directory / RECORDS
        if records_path.exists():
            try:
                if not records_path.is_file():
                    problems.append(f"{RECORDS} is {_kind(records_path)}, not a file; benchlib merge-records {directory}")
                else:
                    row["records"] = len(pd.read_parquet(records_path, columns=["value"]))
            except Exception as error:
                problems.append(f"{RECORDS} unreadable ({type(error).__name__}); benchlib merge-records {directory}")
        row["problem"] = "; ".join(problems)
        rows.append(row)
    columns = ["run_id", "state", "started_at", "ended_at", "device", "host", "git_commit", "notebooks", "failed",
               "records", "problem", "path"]
    frame = pd.DataFrame(rows, columns=columns)
    return frame.sort_values("started_at", kind="stable", na_position="first").reset_index(drop=True)
