"""A benchmark's one declaration: what it asks, its typed parameters, how it runs, how it is judged.

Everything that needs to know about a benchmark reads its `Benchmark`: `benchlib list`, the
runner's planning and refusals (exit 2 before any kernel starts), the values a notebook receives,
run.json (question and seed, for the report), the seed verdicts and `compare`. A benchmark either
has a notebook (`notebook`, a file name in the project's `notebooks/` or a path) or a `measure`
function that returns records; the runner executes the latter in a generic notebook, so both run
in a fresh kernel with the same progress, timeouts and failure handling.

    BENCHMARK = Benchmark(
        name="my_bench", question="Does X cost more memory than Y?",
        parameters=(Parameter("n", 1000, "problem size", quick=10, minimum=1),),
        measure=my_measure)                     # my_measure(config, device) -> records
"""

from __future__ import annotations

import ast
import difflib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchlib.errors import Refused
from benchlib.engine_names import split_names

# The memory a plan may use: sizes above this share of the device's available memory are refused.
MEMORY_HEADROOM = 0.9
INJECTED = ("device", "results_dir")  # set by the runner from --device and the run directory, never declared
# A notebook's parameters cell may set it: True starts from the declared quick values (`benchlib run --quick`
# injects those values themselves, so the runner never sets it).
QUICK_SWITCH = "quick"
_NO_QUICK = object()
_SCALARS = (bool, int, float, str)


class ParameterError(Refused):
    """A parameter value a benchmark refuses; the message names the benchmark, the parameter and what is valid."""


class DeclarationError(Refused):
    """A `Benchmark` that cannot be run as declared (missing fields, defaults its own checks refuse)."""


@dataclass(frozen=True)
class Parameter:
    """One typed parameter. Its type is its default's (`int`, `float`, `bool`, `str`, or a non-empty
    list of one of those); `choices`, `minimum` and `maximum` bound a value or each item of a list."""

    name: str
    default: Any
    help: str
    quick: Any = _NO_QUICK
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None

    def __post_init__(self):
        if not self.name.isidentifier() or self.name in INJECTED:
            raise DeclarationError(f"parameter name {self.name!r} must be an identifier other than {', '.join(INJECTED)}")
        default = self.default
        if isinstance(default, (list, tuple)):
            if not default or not all(type(v) is type(default[0]) and isinstance(v, _SCALARS) for v in default):
                raise DeclarationError(f"parameter {self.name}: a list default must be non-empty and of one type "
                                       f"(int, float, bool or str), got {default!r}")
            object.__setattr__(self, "default", tuple(default))
        elif not isinstance(default, _SCALARS):
            raise DeclarationError(f"parameter {self.name}: the default must be an int, float, bool, str or a list "
                                   f"of one of those, got {default!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        self.check(self.default)  # a default its own rules refuse is a broken declaration, not a user error
        if self.has_quick:
            self.check(self.quick)

    @property
    def is_list(self) -> bool:
        return isinstance(self.default, tuple)

    @property
    def item_type(self) -> type:
        return type(self.default[0]) if self.is_list else type(self.default)

    @property
    def type_name(self) -> str:
        item = self.item_type.__name__
        return f"list[{item}]" if self.is_list else item

    @property
    def has_quick(self) -> bool:
        return self.quick is not _NO_QUICK

    def valid(self) -> str:
        """What a value must be, in words: the second half of every refusal."""
        if self.choices:
            what = f"one of {', '.join(map(str, self.choices))}"
        else:
            low = "" if self.minimum is None else f">= {self.minimum:g}"
            high = "" if self.maximum is None else f"<= {self.maximum:g}"
            what = f"{'an integer' if self.item_type is int else 'a number' if self.item_type is float else 'True or False' if self.item_type is bool else 'a ' + self.item_type.__name__}" + (
                f" {' and '.join(p for p in (low, high) if p)}" if low or high else "")
        return f"a non-empty list, each {what}" if self.is_list else what

    def _item(self, value: Any) -> Any:
        expected = self.item_type
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:  # an int past float's range (-p scale=1 and 400 zeros)
                raise ValueError from None
        if type(value) is not expected:
            raise ValueError
        if self.choices and value not in self.choices:
            raise ValueError
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (isinstance(value, float) and not math.isfinite(value)) or \
                    (self.minimum is not None and value < self.minimum) or \
                    (self.maximum is not None and value > self.maximum):
                raise ValueError
        return value

    def check(self, value: Any) -> Any:
        """`value` as this parameter holds it (int -> float, list -> tuple), or ParameterError saying what is valid."""
        refused = f"{self.name} must be {self.valid()}, got {value!r}"
        if not self.is_list:
            try:
                return self._item(value)
            except ValueError:
                raise ParameterError(refused) from None
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
            raise ParameterError(refused)
        checked = []
        for item in value:
            try:
                checked.append(self._item(item))
            except ValueError:
                raise ParameterError(f"{refused} ({item!r} is not valid)") from None
        return tuple(checked)

    def parse(self, text: str) -> Any:
        """A command-line value: a Python literal where it is one (one item stands for a list of one); a
        str parameter takes the text as typed, a list of str also `a,b`."""
        import ast

        if self.item_type is str and not self.is_list:
            return self.check(text)
        if self.item_type is bool and not self.is_list and text.strip().lower() in ("true", "false"):
            return self.check(text.strip().lower() == "true")  # as a shell user writes it: -p download=false
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = split_names(text) if self.is_list and self.item_type is str else text
        if self.is_list and isinstance(value, _SCALARS) and not (isinstance(value, str) and self.item_type is not str):
            value = [value]  # one item given for a list: `-p T_sweep=25`
        return self.check(value)

    def describe(self) -> str:
        """Two lines: name, type, default and quick value; then the help and, where bounded, what is valid."""
        default = list(self.default) if self.is_list else self.default
        quick = f"  (quick: {list(self.quick) if isinstance(self.quick, tuple) else self.quick!r})" if self.has_quick else ""
        bounded = self.choices or self.minimum is not None or self.maximum is not None
        return f"{self.name}: {self.type_name} = {default!r}{quick}\n    {self.help}" + (f"; {self.valid()}" if bounded else "")


@dataclass(frozen=True)
class Seed:
    """The public discussion a benchmark reproduces."""

    title: str
    link: str = ""


class Config(Mapping):
    """A benchmark's checked parameter values, read as attributes (`config.depth`) or as a mapping
    (`**config`); frozen. Only `Benchmark.config` makes one, so holding one means it was checked.
    `at_quick_values`: built from the declared quick values (a notebook's `quick = True`), so a run
    made from it says it is a first look, as `--quick` does."""

    __slots__ = ("benchmark", "_values", "at_quick_values")

    def __init__(self, benchmark: str, values: Mapping[str, Any], at_quick_values: bool = False):
        object.__setattr__(self, "benchmark", benchmark)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "at_quick_values", at_quick_values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{self.benchmark} has no parameter {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Config is frozen: build another with Benchmark.config(...)")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Config({self.benchmark}: " + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def plain(self) -> dict[str, Any]:
        """The values with lists as lists: what a notebook cell or JSON holds."""
        return {name: list(value) if isinstance(value, tuple) else value for name, value in self._values.items()}


Rules = Callable[[Config], None]
MemoryEstimate = Callable[[Config, Any], int]
Measure = Callable[[Config, Any], Any]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark, declared once.

    `cases` says in a sentence what is measured for each engine (or variant) and size.
    `rules(config)` raises ValueError for combinations the parameters' own bounds cannot express
    (steps > warmup, budgets <= depth, engines valid for a dtype); `memory(config, device)` is the
    bytes the sizes need on `device`, refused above `MEMORY_HEADROOM` of what is available.
    `headline` names the metrics its summary leads with; `verdicts` are its seed rules
    (`benchlib.analysis.seed_verdicts.RatioRule` / `SlopeRule`); `figures` maps a figure's name to a
    builder of the run's records frame (drawn by the generic notebook; a notebook draws its own).
    `metrics` ((name, unit, kind, meaning), ...) and `dimensions` ({name: meaning}) are the metrics
    and kinds of variant its records use that benchlib does not know yet: checked when declared and
    registered by `register`, so a new benchmark needs no edit to `benchlib.records`; `colors` ({series: colour})
    are its own series' colours in every figure (`benchlib.report.palette`; engines have theirs).
    `summarize(records)`, if
    given, builds the headline table instead of the medians of the `headline` metrics; a `summary`
    column of one line per row is what `benchlib run` prints first after the run. `yardstick` marks a
    benchmark that measures the machine rather than the code: a full run takes it first, and
    `benchlib compare` reads its timings as the machine's own drift between two runs.
    """

    name: str
    question: str
    parameters: tuple[Parameter, ...]
    seed: Seed | None = None
    cases: str = ""
    notebook: str | None = None
    measure: Measure | None = None
    rules: Rules | None = None
    memory: MemoryEstimate | None = None
    headline: tuple[str, ...] = ()
    verdicts: tuple = ()
    figures: Mapping[str, Callable] = field(default_factory=dict)
    metrics: tuple[tuple[str, str, str, str], ...] = ()
    dimensions: Mapping[str, str] = field(default_factory=dict)
    colors: Mapping[str, str] = field(default_factory=dict)
    summarize: Callable | None = None
    yardstick: bool = False

    def __post_init__(self):
        object.__setattr__(self, "parameters", tuple(self.parameters))
        object.__setattr__(self, "headline", tuple(self.headline))
        object.__setattr__(self, "verdicts", tuple(self.verdicts))
        problems = []
        if not isinstance(self.name, str) or not self.name.isidentifier():
            problems.append(f"name must be an identifier, got {self.name!r}")
        if not isinstance(self.question, str) or not self.question.strip():
            problems.append("question must say, in one sentence, what the benchmark answers")
        if not all(isinstance(p, Parameter) for p in self.parameters):
            problems.append("parameters must be Parameter objects")
        names = [p.name for p in self.parameters if isinstance(p, Parameter)]
        if len(set(names)) != len(names):
            problems.append(f"a parameter is declared twice: {sorted(n for n in names if names.count(n) > 1)}")
        if (self.notebook is None) == (self.measure is None):
            problems.append("give exactly one of notebook (a notebook file) or measure (a function returning records)")
        other = [rule for rule in self.verdicts if getattr(rule, "benchmark", self.name) != self.name]
        if other:
            problems.append(f"verdict rules name another benchmark: {sorted({r.benchmark for r in other})}")
        problems += self._metric_problems()
        if problems:
            raise DeclarationError(f"benchmark {self.name!r}: " + "; ".join(problems))

    def _metric_problems(self) -> list[str]:
        from benchlib.records.metrics import MetricError, checked_metric

        try:
            for metric in self.metrics:
                checked_metric(*metric)
        except (MetricError, TypeError) as error:
            return [f"metrics: {error}"]
        return []

    def register(self) -> Benchmark:
        """Its metrics, dimensions and colours into the shared registries, so the records it writes validate and
        its series keep their colours: the one step that does, taken by discovery (`benchlib.registry`) for every
        declared benchmark and by `config`, which every measurement starts from. Declaring a benchmark registers
        nothing. The same meaning twice is fine; another meaning for a name is refused (DeclarationError)."""
        from benchlib.records.metrics import METRICS, MetricError
        from benchlib.records.schema import DIMENSIONS

        try:
            for metric in self.metrics:
                METRICS.register(*metric)
        except (MetricError, TypeError) as error:
            raise DeclarationError(f"benchmark {self.name!r}: metrics: {error}") from None
        for dimension, meaning in self.dimensions.items():
            if DIMENSIONS.setdefault(dimension, meaning) != meaning:
                raise DeclarationError(f"benchmark {self.name!r}: dimension {dimension!r} is already declared as "
                                       f"{DIMENSIONS[dimension]!r}")
        if self.colors:  # the palette is presentation's: loaded only for a benchmark that has colours of its own
            from benchlib.report.palette import PaletteError, register

            try:
                register(self.name, self.colors)
            except PaletteError as error:
                raise DeclarationError(f"benchmark {self.name!r}: colors: {error}") from None
        return self

    def __repr__(self) -> str:
        return f"Benchmark({self.name!r})"

    def parameter(self, name: str) -> Parameter:
        for parameter in self.parameters:
            if parameter.name == name:
                return parameter
        raise ParameterError(f"{self.name} has no parameter {name!r}; its parameters are:\n{self.describe_parameters()}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parameters)

    @property
    def quick(self) -> dict[str, Any]:
        """The values `--quick` sets: smaller sizes for a first look."""
        return {p.name: p.quick for p in self.parameters if p.has_quick}

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.parameters}

    def describe_parameters(self) -> str:
        return "\n".join("  " + p.describe().replace("\n", "\n  ") for p in self.parameters)

    def config(self, values: Mapping[str, Any] | None = None, *, device: Any = None) -> Config:
        """The checked Config: defaults overridden by `values`, each value by its parameter, then
        `rules`, then (when a `device` is given) `memory` against what that device has available.
        Names the runner injects (device, results_dir) are ignored; unknown names are refused. Every
        measurement starts from a Config, so making one registers the benchmark (`register`): the
        records it writes then validate, in whichever process or kernel made it."""
        self.register()
        values = {k: v for k, v in (values or {}).items() if k not in INJECTED}
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise unknown_parameters(unknown, (self,))
        checked = self.defaults()
        for name, value in values.items():
            try:
                checked[name] = self.parameter(name).check(value)
            except ParameterError as error:
                raise ParameterError(f"{self.name}: {error}") from None
        config = Config(self.name, checked)
        try:
            if self.rules is not None:
                self.rules(config)
            if device is not None and self.memory is not None:
                self._fits(int(self.memory(config, device)), device)
        except ValueError as error:
            raise ParameterError(f"{self.name}: {error}") from None
        return config

    def config_from(self, namespace: Mapping[str, Any]) -> Config:
        """The Config from a notebook's variables (`globals()` after its parameters cell).

        In a kernel, only the names the parameters cell assigns count (papermill's injected cell
        when the runner ran it), so a name left over from an earlier run of the cell is not read and a
        misspelt one (`dept = 8`) is refused as `benchlib run -p` refuses it. `quick = True` there
        starts from the declared quick values; the cell's own values still win.
        """
        assigned = parameters_cell_names(namespace)
        if assigned is None:  # not in IPython (a script): every declared name the namespace holds
            assigned = {name for name in (*self.names, QUICK_SWITCH) if name in namespace}
        switch = QUICK_SWITCH not in self.names and QUICK_SWITCH in assigned and namespace.get(QUICK_SWITCH, False)
        if not isinstance(switch, bool):
            raise ParameterError(f"{self.name}: quick must be True or False, got {switch!r}")
        unknown = sorted(assigned - set(self.names) - set(INJECTED) - {QUICK_SWITCH})
        if unknown:
            raise unknown_parameters(unknown, (self,))
        values = {name: namespace[name] for name in self.names if name in assigned and name in namespace}
        config = self.config({**(self.quick if switch else {}), **values})
        return Config(config.benchmark, config, at_quick_values=True) if switch else config

    def _fits(self, required: int, device: Any) -> None:
        from benchlib.measure.isolation import available_memory

        available = available_memory(device)
        if required > MEMORY_HEADROOM * available:
            raise Refused(
                f"these sizes need about {required / 1e9:.2f} GB, but {available / 1e9:.2f} GB are available on "
                f"{device.name} ({MEMORY_HEADROOM:.0%} may be planned); choose smaller sizes")

    def run_info(self) -> dict[str, Any]:
        """What run.json keeps of the declaration: enough for the report to introduce the section."""
        return {"question": self.question, "cases": self.cases, "seed": None if self.seed is None else {"title": self.seed.title,
                                                                                  "link": self.seed.link},
                "headline": list(self.headline)}


def unknown_parameters(names: Sequence[str], benchmarks: Sequence[Benchmark]) -> ParameterError:
    """The refusal of names no benchmark declares: one text for `benchlib run -p` and a notebook's
    parameters cell, with the closest declared name where one is close and every valid one listed."""
    known = sorted({name for benchmark in benchmarks for name in benchmark.names})
    named = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1)
        named.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    listing = "\n".join(f"{benchmark.name}:\n{benchmark.describe_parameters()}" for benchmark in benchmarks)
    return ParameterError(f"unknown parameter {', '.join(named)}; "
                          f"{'the selected benchmarks take' if len(benchmarks) > 1 else 'valid parameters'}:\n{listing}")


def parameters_cell_names(namespace: Mapping[str, Any]) -> set[str] | None:
    """The names a notebook's parameters cell assigns at its top level, read from IPython's input
    history (`In`): the newest cell run that assigns `results_dir` (papermill's injected cell
    follows the committed one, so under the runner it is the one read). None outside IPython."""
    history = namespace.get("In")
    if not isinstance(history, list):
        return None
    for source in reversed(history):
        try:
            tree = compile(source, "<cell>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except (SyntaxError, ValueError, TypeError):
            continue
        names = set()
        for node in tree.body:
            if _calls_config_from(node):  # a cell that is also the config cell: what follows is not a parameter
                break
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            names.update(name.id for target in targets for name in ast.walk(target)
                         if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store))  # D, depth = 32, 3 too
        if "results_dir" in names:
            return names
    return None


def _calls_config_from(node: ast.AST) -> bool:
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "config_from"
               for call in ast.walk(node))


def exceeds(name: str, value: Any, other_name: str, other: Any) -> None:
    """A rule's check that one parameter is larger than another."""
    if not value > other:
        raise Refused(f"{name} ({value}) must exceed {other_name} ({other})")


def distinct(name: str, values: Sequence[Any]) -> None:
    """A rule's check that a list names each value once."""
    if len(set(values)) != len(values):
        raise Refused(f"{name} lists a value twice: {list(values)}")
