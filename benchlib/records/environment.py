"""What a run was measured on: versions, hardware, allocator settings and the code's commit.

Every figure is only meaningful with this next to it, so `run.json` carries it. Nothing here
imports benchlib.measure (results sits below it); callers pass measure's policy name in.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

# Environment variables that change how memory is allocated and so what memory figures mean.
_ALLOCATOR_ENV = re.compile(r"^(MALLOC_\w*|GLIBC_TUNABLES|PYTORCH_CUDA_ALLOC_CONF|PYTORCH_NO_CUDA_MEMORY_CACHING|"
                            r"OMP_NUM_THREADS|MKL_NUM_THREADS|OPENBLAS_NUM_THREADS)$")
_PACKAGES = ("torch", "numpy", "autograd", "pandas", "pyarrow", "plotly", "papermill", "memray", "psutil")
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def allocator_env() -> dict[str, str]:
    """The environment variables of this process that shape memory and thread figures."""
    return {key: value for key, value in sorted(os.environ.items()) if _ALLOCATOR_ENV.match(key)}


def _package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu() -> dict[str, Any]:
    import psutil

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": usable,
        "memory_total_bytes": psutil.virtual_memory().total,
        # pyperf-style: a load above the usable cores when a run starts makes its times suspect
        "load_average_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _command(args: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _nvidia_smi() -> list[dict[str, str]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = _command(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if out is None:
        return None
    rows = []
    for line in out.splitlines():
        name, driver, memory = (part.strip() for part in line.split(",", 2))
        rows.append({"name": name, "driver": driver, "memory_total": memory})
    return rows


def _gpu(torch: Any) -> dict[str, Any]:
    """GPU name, driver and CUDA version where present; otherwise say why it is absent."""
    smi = _nvidia_smi()
    info: dict[str, Any] = {"cuda_build": torch.version.cuda, "nvidia_smi": smi}
    if not torch.cuda.is_available():
        info["available"] = False
        info["note"] = (
            "torch.cuda.is_available() is False"
            + ("" if torch.version.cuda else " (this torch is a CPU build)")
            + ("; nvidia-smi not found" if shutil.which("nvidia-smi") is None else "")
        )
        return info
    info["available"] = True
    info["devices"] = [
        {
            "index": index,
            "name": torch.cuda.get_device_name(index),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
            "memory_total_bytes": torch.cuda.get_device_properties(index).total_memory,
        }
        for index in range(torch.cuda.device_count())
    ]
    info["driver"] = smi[0]["driver"] if smi else None
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return info


def _git(root: Path) -> dict[str, Any]:
    if shutil.which("git") is None or not (root / ".git").exists():
        return {"commit": None, "dirty": None, "note": f"{root} is not a git checkout"}
    commit = _command(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return {"commit": None, "dirty": None, "note": "git rev-parse HEAD failed (no commits yet?)"}
    status = _command(["git", "status", "--porcelain"], cwd=root)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes: which content of a model file a run measured, or a form check passed."""
    import hashlib

    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()


def file_provenance(path: str | os.PathLike) -> dict[str, Any]:
    """A file a run measured (a user's model file): its path, sha256, and the commit and dirty state of
    the git repository that holds it (None, with a note, outside one)."""
    path = Path(path).resolve()
    root = _command(["git", "rev-parse", "--show-toplevel"], cwd=path.parent) if shutil.which("git") else None
    git = _git(Path(root)) if root else {"commit": None, "dirty": None, "note": f"{path.parent} is not in a git repository"}
    return {"path": str(path), "sha256": file_digest(path),
            "git": {"root": root, **git}}


# torch_facts() as a child reported them (`note_torch_facts`): what a process that imports no torch records
_NOTED_TORCH_FACTS: dict[str, Any] = {}


def torch_facts() -> dict[str, Any]:
    """What torch reports here: its intra-op thread count and the GPUs it sees. Read from torch where this process
    has imported it; else as a child of this process that imported torch reported them (`note_torch_facts`: the
    model-file reader, under this process's environment), so that a process that only plans and starts others,
    `benchlib run`, never imports torch (2-3 s) for run.json; else from torch, imported here."""
    if "torch" not in sys.modules and _NOTED_TORCH_FACTS:
        return dict(_NOTED_TORCH_FACTS)
    import torch

    return {"torch_threads": torch.get_num_threads(), "gpu": _gpu(torch)}


def note_torch_facts(facts: dict[str, Any]) -> None:
    """Keep `torch_facts()` as a child that imported torch under this process's environment reported them."""
    _NOTED_TORCH_FACTS.update(torch_threads=facts["torch_threads"], gpu=facts["gpu"])


def capture_environment(device: Any = None, *, allocator_policy: str | None = None) -> dict[str, Any]:
    """The environment a run measures in; `device` (name or Device) and measure's policy are recorded as given."""
    torch = torch_facts()
    device_name = getattr(device, "name", device)
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "packages": _package_versions(),
        "cpu": _cpu(),
        "torch_threads": torch["torch_threads"],
        "device": device_name,
        "gpu": torch["gpu"],
        "allocator": {
            "env": allocator_env(),
            "isolation_default_policy": allocator_policy,
        },
        "git": _git(_PROJECT_ROOT),
    }
