"""Cases forked from a warm template: each still a new process of its own, starting from what a fresh
interpreter would hold, with a fresh interpreter wherever a template cannot serve."""
import os

import pytest

from benchlib.measure import IsolationOptions, forkserver, run_isolated

pytestmark = pytest.mark.slow
FACTS = dict(name="facts", options=IsolationOptions(timeline=False))


def facts(mode, monkeypatch):
    monkeypatch.setenv(forkserver.ISOLATION_ENV, mode)
    result = run_isolated("isolation_targets:process_facts", **FACTS)
    return result.checks, result.environment["isolation"]


def test_each_case_is_a_new_process_forked_from_one_warm_template(monkeypatch):
    (first, how), (second, _) = facts("fork", monkeypatch), facts("fork", monkeypatch)
    assert how == "fork"
    assert first["pid"] != second["pid"] and os.getpid() not in (first["pid"], second["pid"])
    assert first["ppid"] == second["ppid"] != os.getpid()  # the same template served both


def test_a_forked_case_starts_with_the_code_pages_a_fresh_interpreter_maps(monkeypatch):
    # Fork leaves read-only file mappings unmapped in the child (7 MB of 114 MB here); counted in the
    # measured calls they would inflate every peak, so the child maps the template's pages again first.
    (forked, _), (spawned, how) = facts("fork", monkeypatch), facts("spawn", monkeypatch)
    assert how == "spawn" and spawned["ppid"] == os.getpid()
    assert forked["rss_file_bytes"] == pytest.approx(spawned["rss_file_bytes"], rel=0.05)


def test_a_module_outside_benchlib_is_imported_by_the_child_so_an_edit_is_never_served_stale(tmp_path,
                                                                                               monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "edited_case.py"
    for value in (1, 2):
        module.write_text("from benchlib.measure import Case\n\n"
                          f"def case(device):\n    return Case(lambda: None, lambda _: {{'value': {value}}})\n")
        assert run_isolated("edited_case:case", **FACTS).checks == {"value": float(value)}


def test_a_template_that_cannot_serve_falls_back_to_a_fresh_interpreter_and_says_so(monkeypatch):
    def unavailable(*args, **kwargs):
        raise forkserver.TemplateUnavailable("no template here")

    monkeypatch.setattr(forkserver, "template_for", unavailable)
    result = run_isolated("isolation_targets:process_facts", **FACTS)
    assert result.environment["isolation"] == "spawn" and result.checks["ppid"] == os.getpid()


def test_an_unknown_isolation_mode_is_refused_naming_the_valid_ones(monkeypatch):
    monkeypatch.setenv(forkserver.ISOLATION_ENV, "thread")
    with pytest.raises(ValueError, match="BENCHLIB_ISOLATION='thread': valid values are fork, spawn"):
        run_isolated("isolation_targets:process_facts", **FACTS)


def test_each_malloc_policy_gets_its_own_template(monkeypatch):
    monkeypatch.setenv(forkserver.ISOLATION_ENV, "fork")
    parents = {policy: run_isolated("isolation_targets:environment", name=policy,
                                    options=IsolationOptions(timeline=False, malloc=policy)).checks["mmap_threshold"]
               for policy in ("mmap-128k", "mmap-64k")}
    assert parents == {"mmap-128k": 131072.0, "mmap-64k": 65536.0}
