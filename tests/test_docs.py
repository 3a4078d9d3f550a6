"""The README and docs/ as a newcomer reads them: every link leads to a page and heading that exist, the site
builds without a broken one, the README stays a front door, and docs/architecture.md names the commands,
techniques and engines the code has."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NUMBERS = {10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen", 14: "fourteen", 15: "fifteen", 16: "sixteen"}


def _prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, code = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            code = not code
        elif not code:
            lines.append(line)
    return lines


def _anchor(heading: str) -> str:
    """A heading's anchor as Markdown's table of contents makes it (and GitHub alike, for these headings)."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in _prose(path) if line.startswith("#")}


def _words(path: Path) -> str:
    return " ".join(" ".join(_prose(path)).split())


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_page_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall("\n".join(_prose(page))):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            found = (page.parent / file).resolve() if file else page
            if not found.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and found.suffix == ".md" and anchor not in _anchors(found):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.mark.slow
def test_the_site_builds_strictly_from_docs(tmp_path):
    """`make docs`: mkdocs with --strict fails on a link to a page or heading that is not there, or a page left
    out of the navigation."""
    pytest.importorskip("mkdocs")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                            str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                           env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "distributed.html").exists()


def test_the_readme_is_a_front_door_with_the_two_commands_first():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200
    for command in ("make bench", "make test"):
        assert next(index for index, line in enumerate(readme) if line.startswith(command)) < 40, command


def test_architecture_has_short_lines():
    long = [(number, len(line)) for number, line in enumerate(_prose(ROOT / "docs" / "architecture.md"), 1)
            if len(line) > 120]
    assert not long


def test_architecture_names_every_command_of_each_family_the_cli_has():
    from benchlib.runner.cli import FAMILIES

    for family in FAMILIES:
        commands = argparse.ArgumentParser().add_subparsers()
        family.add_commands(commands, [])
        names = ", ".join(f"`{name}`" for name in commands.choices)
        listed = f"`{family.__name__.rsplit('.', 1)[-1]}`: {names}"
        assert listed in _words(ROOT / "docs" / "architecture.md"), listed


def test_the_docs_name_every_technique_and_array_engine_the_code_registers():
    from benchlib.engines.techniques import BUILTIN, PARALLEL
    from benchlib.usermodel.arrays import ARRAY_ENGINES

    architecture = _words(ROOT / "docs" / "architecture.md")
    users = " ".join(_words(ROOT / "docs" / page) for page in ("your-model.md", "techniques.md", "distributed.md"))
    assert f"benchlib's {NUMBERS[len(BUILTIN)]}" in architecture
    for name in [*BUILTIN, *PARALLEL, *ARRAY_ENGINES]:
        assert f"`{name}`" in architecture, name
    for name in [*BUILTIN, *PARALLEL]:  # where a user looks them up
        assert f"`{name}`" in users, name
