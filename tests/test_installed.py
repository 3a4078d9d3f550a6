"""benchlib installed from its wheel, outside this checkout: the built-in notebooks travel in it, a run finds
them and writes ./results of the folder it runs in, and `benchlib notebooks DIR` copies them out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout and installed (without dependencies: this environment has them)
    into a folder of its own, put first on the path."""
    wheels, target = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(PROJECT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels)], check=True, timeout=300)
    (wheel,) = wheels.glob("benchlib-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    return target


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
