"""Install benchlib (editable) and its [dev] extra into this interpreter's environment at constraints.txt's
versions: `make install` runs it with the project's .venv/bin/python.

uv fills the environment in a fraction of pip's time (torch and about 170 other pinned packages: most of a fresh
clone's `make test` set-up on a 2-core VM was pip unpacking wheels on one core). uv reads no pip configuration,
so it is given the package sources and constraint files pip would use here (`pip config list`) and told to
choose among those sources as pip does, and to compile the packages' bytecode as pip does: where
PYTHONDONTWRITEBYTECODE is set (these machines), no process writes it later, and every process that imports torch
would compile it again (the suite ran at half speed). Where uv cannot be installed or fails, pip installs, and this
says so.

    .venv/bin/python tools/install.py            # what make install runs
    .venv/bin/python tools/install.py --pip      # pip only
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
TARGET = [f"{ROOT}[dev]"]
# pip's settings that say where packages come from, and uv's flag for each (each flag repeats per value)
SOURCES = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}
# pip's configuration scopes, weakest first: a later scope's value replaces an earlier one's, as in pip
SCOPES = ("global", "user", "site", ":env:")


def pip_sources(python: str | Path = sys.executable) -> dict[str, list[str]]:
    """Where pip, run by `python`, finds packages and what constrains them: {setting: values}, the strongest
    scope's value of each (pip's own precedence: environment over site over user over global)."""
    listed = subprocess.run([str(python), "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, tuple[int, list[str]]] = {}
    for line in listed.splitlines():
        key, equals, value = line.partition("=")
        scope, _, setting = key.rpartition(".")
        if not equals or setting not in SOURCES:
            continue
        rank = next((i for i, name in enumerate(SCOPES) if scope == name), 0)
        if setting not in found or rank >= found[setting][0]:
            found[setting] = (rank, value.strip().strip("'\"").split())
    return {setting: values for setting, (_, values) in found.items()}


def uv_command(uv: str | Path, python: str | Path, compile_bytecode: bool = True) -> list[str]:
    """`uv pip install` into the environment of `python`, from the sources and under the constraints pip has
    there, choosing among several sources as pip does (the best version anywhere, not the first source's) and,
    with `compile_bytecode`, compiling every module's bytecode as pip does (an environment whose processes may
    write their own bytecode does without)."""
    command = [str(uv), "pip", "install", "--quiet", "--python", str(python), "--index-strategy", "unsafe-best-match",
               *(["--compile-bytecode"] if compile_bytecode else [])]
    for setting, values in pip_sources(python).items():
        for value in values:
            command += [SOURCES[setting], value]
    return command


def _pip(python: str) -> int:
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=False)
    return subprocess.run([python, "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS), "-e", *TARGET]).returncode


def main(argv: list[str]) -> int:
    python = sys.executable
    if "--pip" in argv:
        return _pip(python)
    got_uv = subprocess.run([python, "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS), "uv"]).returncode
    uv = Path(python).parent / "uv"
    if got_uv == 0 and uv.is_file():
        done = subprocess.run([*uv_command(uv, python), "-c", str(CONSTRAINTS), "-e", *TARGET])
        if done.returncode == 0:
            return 0
        print(f"tools/install.py: uv failed (exit {done.returncode}); installing with pip instead", file=sys.stderr)
    else:
        print("tools/install.py: uv could not be installed; installing with pip instead", file=sys.stderr)
    return _pip(python)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
