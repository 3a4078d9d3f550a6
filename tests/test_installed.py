"""benchlib installed from its wheel, outside this checkout: the built-in notebooks travel in it, a run finds
them and writes ./results of the folder it runs in, and `benchlib notebooks DIR` copies them out."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout."""
    wheels = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(PROJECT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels)], check=True, timeout=300)
    (built,) = wheels.glob("benchlib-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel):
    """The wheel installed (without dependencies: this environment has them) into a folder of its own, put
    first on the path."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    return target


@pytest.mark.slow
def test_the_wheel_declares_ranges_that_keep_a_projects_own_torch(wheel):
    """What pip reads from the wheel: ranges, never a pin, so installing benchlib beside torch 2.12 or
    2.14 keeps that torch (2.14.1 for real: the next test; each range's lower end is tested by `make lowest`)."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    requirements = {requirement.name: requirement for requirement in
                    (Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:"))
                    if requirement.marker is None or requirement.marker.evaluate({"extra": ""})}
    assert not [name for name, requirement in requirements.items()
                if any(spec.operator in ("==", "===") for spec in requirement.specifier)]
    torch = requirements["torch"].specifier
    # the tested ends: 2.6.0 (`make lowest`), 2.11.0 (a lent GPU's), 2.13.0 (the pin), 2.14.1 (the next test)
    assert all(torch.contains(version) for version in ("2.6.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1"))
    assert not torch.contains("2.5.1") and not torch.contains("3.0.0")
    numpy = requirements["numpy"].specifier  # allocation counts are tested under 2.0 and 2.4; 2.5 counts NumPy's buffers
    assert numpy.contains("2.0.0") and numpy.contains("2.4.6") and not numpy.contains("1.26.4")
    assert not numpy.contains("2.5.0")
    assert "Programming Language :: Python :: 3" in "\n".join(lines)


@pytest.mark.slow
def test_the_wheel_carries_its_apache_licence_and_valid_metadata(wheel):
    """PEP 639 metadata: the SPDX expression, the licence text in the wheel, and no invented project URL;
    packaging's own validation (what twine check reads) accepts every field."""
    import zipfile

    from packaging.metadata import Metadata

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        raw = archive.read(metadata_name)
        (licence_name,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
        licence = archive.read(licence_name).decode()
    metadata = Metadata.from_email(raw, validate=True)
    assert str(metadata.license_expression) == "Apache-2.0"
    assert metadata.license_files == ["LICENSE"]
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert licence == (PROJECT / "LICENSE").read_text()
    assert not metadata.project_urls and metadata.home_page is None


def benchlib(installed, *args, cwd):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    env.pop("BENCHLIB_RESULTS", None)
    return subprocess.run([sys.executable, "-m", "benchlib", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_the_installed_copy_runs_its_own_notebooks_into_the_folder_it_runs_in(installed, tmp_path):
    listed = benchlib(installed, "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert f"({installed / 'share' / 'benchlib' / 'notebooks' / 'dot_chain.ipynb'})" in listed.stdout
    done = benchlib(installed, "run", "dot_chain", "--quick", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run,) = (tmp_path / "results").iterdir()
    assert (run / "records.parquet").is_file() and (run / "report.html").is_file()
    copied = benchlib(installed, "notebooks", "mine", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert {path.name for path in (tmp_path / "mine").iterdir()} >= {"dot_chain.ipynb", "your_model.ipynb"}
    again = benchlib(installed, "notebooks", "mine", cwd=tmp_path)
    assert again.returncode == 2 and "never overwrites" in again.stderr


OTHER_TORCH = "2.14.1"  # not the pinned 2.13.0: the other release pip finds on this project's machines' disk
GATE_TEST = '''import pytest


@pytest.mark.limit_gradient_step(peak="{peak}")
def test_step_stays_lean(gradient_step):
    gradient_step("model.py", "torch")
'''


def _run(*command, cwd=None, timeout=900, env=None):
    # the fresh environment's bytecode is written where this machine's set-up asks for none: each of its processes
    # would compile torch's and pandas' modules again
    clean = {key: value for key, value in os.environ.items()
             if key not in ("PYTHONPATH", "BENCHLIB_RESULTS", "PYTHONDONTWRITEBYTECODE")}
    return subprocess.run([str(part) for part in command], cwd=cwd, env={**clean, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def _installer(python: Path) -> list:
    """The command that installs into the environment of `python`: uv where this environment
    has it (a fresh environment filled with torch and its CUDA libraries in seconds where pip takes minutes), given
    pip's package sources and constraints here as `make install` gives them (tools/install.py); else that
    environment's pip."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        return [python, "-m", "pip", "install", "-q"]
    spec = importlib.util.spec_from_file_location("install", PROJECT / "tools" / "install.py")
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)
    return install.uv_command(uv, python, compile_bytecode=False)  # its processes write what they import


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes of work beside the suite's other workers
def test_installed_beside_another_torch_it_keeps_that_torch_and_runs_a_model_file_and_the_gate(wheel, tmp_path):
    """A user's own environment: a fresh virtual environment with torch 2.14.1 installed first, then the wheel
    with its dependencies (at the project's pins, torch's excepted); the installer keeps that torch, and from a folder
    outside the checkout a model file runs on it and the pytest plugin gates a test of it. About 6 GB while it
    runs, removed after."""
    free = shutil.disk_usage(tmp_path).free
    if free < 12 * 2**30:
        pytest.skip(f"{free / 2**30:.1f} GiB free where the test's environment would go; it needs 12 GiB")
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    try:
        assert _run(getattr(sys, "_base_executable", sys.executable), "-m", "venv", venv).returncode == 0
        install = _installer(python)
        torch = _run(*install, f"torch=={OTHER_TORCH}")
        if torch.returncode != 0:  # not on this machine's disk, and no registry serves it here
            pytest.skip(f"torch {OTHER_TORCH} could not be installed here: {torch.stderr.strip()[-300:]}")
        pins = tmp_path / "pins.txt"
        pins.write_text("".join(line for line in (PROJECT / "constraints.txt").read_text().splitlines(keepends=True)
                                if not line.startswith("torch")))
        installed = _run(*install, "-c", pins, wheel, "pytest")
        assert installed.returncode == 0, installed.stderr[-2000:]
        kept = _run(python, "-c", "import torch, benchlib; print(torch.__version__, benchlib.__file__)", cwd=tmp_path)
        version, location = kept.stdout.split()
        assert version.startswith(OTHER_TORCH) and location.startswith(str(venv))

        project = tmp_path / "project"
        project.mkdir()
        assert _run(python, "-m", "benchlib", "new", "model.py", cwd=project).returncode == 0
        done = _run(python, "-m", "benchlib", "run", "model.py", "--quick", "-p", "engines=torch,torch-checkpoint",
                    "--no-progress", cwd=project)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        (run,) = (project / "results").iterdir()
        assert json.loads((run / "run.json").read_text())["environment"]["packages"]["torch"] == OTHER_TORCH

        (project / "test_gate.py").write_text(GATE_TEST.format(peak="64 MiB"))
        gate = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_gate.py"]
        saved = _run(*gate, "--benchlib-save-baselines", cwd=project)
        assert saved.returncode == 0, saved.stdout[-2000:]
        assert _run(*gate, cwd=project).returncode == 0
        (project / "test_gate.py").write_text(GATE_TEST.format(peak="10 kB"))
        over = _run(*gate, cwd=project)
        assert over.returncode == 1 and "exceeds the limit 10.00 kB" in over.stdout
    finally:
        shutil.rmtree(venv, ignore_errors=True)
