"""Cases forked from a warm template: each still a new process of its own, starting from what a fresh
interpreter would hold, with a fresh interpreter wherever a template cannot serve."""
import os

import pytest

from benchlib.measure import IsolationOptions, forkserver, prepare_isolation, run_isolated

pytestmark = pytest.mark.slow
FACTS = dict(name="facts", options=IsolationOptions(timeline=False))


def facts(mode, monkeypatch, target="isolation_targets:process_facts", preload=()):
    monkeypatch.setenv(forkserver.ISOLATION_ENV, mode)
    result = run_isolated(target, name="facts", options=IsolationOptions(timeline=False, preload=preload))
    return result.checks, result.environment["isolation"]


def test_each_case_is_a_new_process_forked_from_one_warm_template(monkeypatch):
    (first, how), (second, _) = facts("fork", monkeypatch), facts("fork", monkeypatch)
    assert how == "fork" and first["named_as_case"] == 1.0
    assert first["pid"] != second["pid"] and os.getpid() not in (first["pid"], second["pid"])
    assert first["ppid"] == second["ppid"] != os.getpid()  # the same template served both


def test_a_forked_case_starts_with_the_code_pages_a_fresh_interpreter_maps(monkeypatch):
    # Fork leaves read-only file mappings unmapped in the child (7 MB of 114 MB here); counted in the
    # measured calls they would inflate every peak, so the child maps the template's pages again first.
    target = "isolation_targets:torch_process_facts"
    (forked, _), (spawned, how) = facts("fork", monkeypatch, target, ("torch",)), facts("spawn", monkeypatch, target)
    assert how == "spawn" and spawned["ppid"] == os.getpid() and spawned["named_as_case"] == 1.0
    assert forked["rss_file_bytes"] == pytest.approx(spawned["rss_file_bytes"], rel=0.05)


def test_a_template_holds_torch_only_for_a_case_that_imports_it_anyway(monkeypatch):
    # a numpy engine's collector walks no torch objects, as in a fresh interpreter
    assert facts("fork", monkeypatch)[0]["holds_torch"] == 0.0
    assert facts("fork", monkeypatch, preload=("torch",))[0]["holds_torch"] == 1.0
    assert facts("spawn", monkeypatch, preload=("torch",))[0]["holds_torch"] == 0.0  # set-up would import it


def test_a_child_owns_the_pages_of_a_template_that_preloaded_what_a_step_imports_later(monkeypatch):
    # torch._dynamo is imported during a step, not at start-up: a process that imported it itself shares none of
    # its pages, so a child of a template that preloaded it takes them as its own before its case, copying only
    # pages already resident; a template of torch alone leaves them shared, as it did
    target = "isolation_targets:dynamo_process_facts"
    owned, _ = facts("fork", monkeypatch, target, ("torch", "torch._dynamo"))
    left, _ = facts("fork", monkeypatch, target, ("torch",))
    spawned, _ = facts("spawn", monkeypatch, target)
    assert owned["shared_pages"] == 0 and left["shared_pages"] > 10_000
    assert spawned["shared_pages"] < 1_000  # pages read, never written, map the kernel's one zero page
    assert owned["rss_anon_bytes"] == pytest.approx(spawned["rss_anon_bytes"], rel=0.05)


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

    monkeypatch.setattr(forkserver, "run_in_template", unavailable)
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


def test_an_interrupted_exchange_closes_its_template_so_no_later_case_reads_its_replies(monkeypatch):
    before, _ = facts("fork", monkeypatch)
    answer = forkserver.Template._reply

    def interrupted(self, timeout_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(forkserver.Template, "_reply", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_isolated("isolation_targets:process_facts", **FACTS)
    monkeypatch.setattr(forkserver.Template, "_reply", answer)
    after, how = facts("fork", monkeypatch)
    assert how == "fork" and after["ppid"] != before["ppid"]  # a new template, in step with its requests
    assert after["pid"] != before["pid"]


def test_without_a_pagemap_to_map_the_code_again_every_case_spawns(monkeypatch):
    monkeypatch.setattr(forkserver, "FORK_SUPPORTED", False)
    checks, how = facts("fork", monkeypatch)
    assert how == "spawn" and checks["ppid"] == os.getpid()


def test_a_template_started_ahead_serves_the_first_case_even_after_the_import_path_grows(tmp_path, monkeypatch):
    # the gate starts the template before it imports the model file, whose folder joins sys.path
    monkeypatch.setenv(forkserver.ISOLATION_ENV, "fork")
    options = IsolationOptions(timeline=False, preload=("json",))
    prepare_isolation(options)
    started = [template.pid for key, template in forkserver._templates.items() if key[2] == ("json",)]
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run_isolated("isolation_targets:process_facts", name="facts", options=options)
    assert len(started) == 1 and result.checks["ppid"] == started[0]
