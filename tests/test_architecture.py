"""The rules of docs/architecture.md that a reading of the source can check: imports point down the
layers, only the measuring and scheduling code reads a clock, and "which benchmark runs first" is
said by a declaration, not by a name written in the runner."""

import ast
import pathlib
import re

import benchlib

PACKAGE = pathlib.Path(benchlib.__file__).parent
# Bottom to top; a part may import its own layer's other modules and anything in a lower layer.
LAYERS = (
    ("units", "source_files", "engine_names", "lazy_exports", "errors"),
    ("records", "autodiff"),
    ("analysis",),
    ("measure",),
    ("report",),
    ("benchmark",),
    ("engines",),
    ("trials",),
    ("usermodel",),
    ("fit",),
    ("zoo",),
    ("workloads",),
    ("registry",),
    ("runner", "pytest_plugin"),
    ("__init__", "__main__"),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _part(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_parts(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("benchlib"):
            parts = node.module.split(".")
            if len(parts) > 1:
                yield node.lineno, parts[1]
            else:
                yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.split(".")[1]) for alias in node.names
                        if alias.name.startswith("benchlib."))


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(path) for path in PACKAGE.rglob("*.py")}
    assert parts <= set(RANK), f"give these a layer in LAYERS and docs/architecture.md: {sorted(parts - set(RANK))}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        me = _part(path)
        for line, target in _imported_parts(ast.parse(path.read_text(encoding="utf-8"))):
            if target in RANK and RANK[target] > RANK[me]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert upward == []


def test_only_measure_and_the_schedulers_read_a_clock():
    """A figure is timed by benchlib.measure, so a fix to the loop is made once; runner (timeouts, the
    budget), trials (the deadline) and fit (the time left it tells) read the wall clock to decide what runs
    or to say how long it will take, never to make a figure."""
    clock = re.compile(r"perf_counter|time\.time\(|monotonic|process_time|import time\b|from time import")
    schedulers = {"measure", "runner", "trials", "fit"}
    readers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if _part(path) not in schedulers and clock.search(path.read_text(encoding="utf-8")))
    assert readers == []


def test_only_report_knows_the_figure_libraries():
    """plotly and kaleido (figures, their files, PNG export through a browser) are presentation: the records
    layer writes files and lists runs, and nothing that measures or judges draws."""
    drawing = []
    for path in PACKAGE.rglob("*.py"):
        if _part(path) == "report":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            drawing += [f"{path.relative_to(PACKAGE)}:{node.lineno} {name}" for name in names
                        if name.split(".")[0] in ("plotly", "kaleido")]
    assert not drawing


LONGEST = 60  # lines of a function below its docstring
# Exempt by what they are: a command family's argument declarations (one parser call per option), and a seed's
# hand-written gradient transcribed with its buffer lifetimes (split, its temporaries would die earlier than the
# seed's, and the peak measured would not be the seed's).
LONG_BY_NATURE = {"add_commands", "bench_rnn_seed_gradient"}


def test_no_function_is_longer_than_sixty_lines_below_its_docstring():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in LONG_BY_NATURE:
                continue
            first = node.body[0]
            docstring = (first.end_lineno - first.lineno + 1 if isinstance(first, ast.Expr)
                         and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str) else 0)
            lines = node.end_lineno - node.lineno + 1 - docstring
            if lines > LONGEST:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


def _calls(name: str, *, bare: bool = False) -> list[str]:
    """Where the package calls `name` (a function, class or method; `bare`: with no arguments), as path:line."""
    return [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
            and not (bare and (node.args or node.keywords))]


def test_the_stopping_rule_is_built_in_one_place_beside_the_trial_loop():
    assert [call.split(":")[0] for call in _calls("TrialStopping")] == ["trials/loop.py"]


def test_what_tests_replace_is_injected_not_looked_up_per_call():
    """A child runner is a parameter (`isolate=`), so production code never re-reads a module attribute a test
    may have swapped."""
    looked_up = [f"{path.relative_to(PACKAGE)}" for path in PACKAGE.rglob("*.py")
                 if re.search(r"benchlib\.measure\.run_(isolated|ranks)\(", path.read_text(encoding="utf-8"))]
    assert looked_up == []


def test_a_benchmark_is_registered_by_one_explicit_step():
    """Declaring a Benchmark registers nothing; `register()` is called by discovery, a model file's resolution and
    `config()`, which every measurement starts from, and by the one workload that makes another benchmark's records
    (mnist_ensembles' FLOP floor, from calibration's own measurement)."""
    assert sorted(call.split(":")[0] for call in _calls("register", bare=True)) == [
        "benchmark.py", "registry.py", "registry.py", "workloads/ensembles/floor.py"]


def test_which_benchmark_runs_first_is_declared_not_named():
    from benchlib import registry

    assert list(registry.benchmarks())[0] in registry.yardsticks() == ("calibration",)
    for module in ("registry.py", "runner/notebooks.py", "analysis/compare.py"):
        assert not re.search(r"[\"']calibration[\"']", (PACKAGE / module).read_text(encoding="utf-8")), module


def test_no_benchmark_is_named_outside_its_own_module():
    """A benchmark's metrics, dimensions, colours, verdicts and figures are declared with it, so nothing
    central names it. The one exception is frozen history: the upgrade of version-1 records, whose old
    columns differ by benchmark and never change again."""
    from benchlib import registry

    upgrade = PACKAGE / "records" / "schema.py"
    named = []
    for name, benchmark in registry.benchmarks().items():
        module = registry_module_path(benchmark)
        literal = re.compile(rf"[\"']{re.escape(name)}[\"']")
        for path in PACKAGE.rglob("*.py"):
            if path == upgrade or path == module or module in path.parents:
                continue
            named += [f"{path.relative_to(PACKAGE)} names {name!r}"] if literal.search(path.read_text(encoding="utf-8")) else []
    assert named == []


def registry_module_path(benchmark) -> pathlib.Path:
    """The file (or package folder) whose BENCHMARK is `benchmark`."""
    import sys

    module = next(module for name, module in list(sys.modules.items())
                  if name.startswith("benchlib.workloads.") and getattr(module, "BENCHMARK", None) is benchmark)
    path = pathlib.Path(module.__file__)
    return path.parent if path.name == "__init__.py" else path


def test_no_function_takes_more_than_eight_parameters():
    """Past eight, the parameters want a name of their own (an options object, a result that says
    what did not run): the count a caller must hold in mind stays small."""
    wide = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                named = [a.arg for a in args.posonlyargs + args.args]
                count = (len(named) + len(args.kwonlyargs) + bool(args.vararg) + bool(args.kwarg)
                         - bool(named and named[0] in ("self", "cls")))
                if count > 8:
                    wide.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} takes {count}")
    assert wide == []


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(tree: ast.AST, modules: set[str]):
    """Every benchlib module a file imports, anywhere in it (a function's body, a type-checking block): the module
    named, or the module a `from package import name` takes when that name is one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("benchlib"):
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("benchlib"))


def test_a_package_init_only_re_exports():
    """Definitions live in modules named for them; a package's __init__ holds its docstring, imports and the names it
    re-exports (lazily: `lazy_exports`). A workload package's __init__ is its declaration (`BENCHMARK`, its rules),
    which discovery reads there."""
    allowed = (ast.Import, ast.ImportFrom)
    found = []
    for path in sorted(PACKAGE.rglob("__init__.py")):
        if path.relative_to(PACKAGE).parts[0] == "workloads":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            names = [target.id for target in getattr(node, "targets", []) if isinstance(target, ast.Name)]
            exports = isinstance(node, ast.Assign) and set(names) <= {"__all__", "_HOMES", "__getattr__"}
            lazy = isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            if not (docstring or exports or lazy or isinstance(node, allowed)):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def test_no_two_modules_import_each_other_even_through_others():
    """Module by module, not only part by part: a circle inside a part (two files each needing the other) is a
    job split in the wrong place. A package's __init__ only re-exports, so arrows into it are not followed."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    packages = {_module_name(path) for path in PACKAGE.rglob("__init__.py")}
    arrows = {name: {target for target in _imported_modules(ast.parse(path.read_text(encoding="utf-8")), set(files))
                     if target in files and target not in packages and target != name}
              for name, path in files.items() if name not in packages}
    circles, done = [], set()

    def walk(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(" -> ".join(trail[trail.index(name):] + [name]))
            return
        if name in done:
            return
        for target in sorted(arrows.get(name, ())):
            walk(target, trail + [name])
        done.add(name)

    for name in sorted(arrows):
        walk(name, [])
    assert circles == []
