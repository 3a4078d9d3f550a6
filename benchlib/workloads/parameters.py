"""Each benchmark notebook's parameter values checked by its workload's own rules, before any kernel starts.

The runner checks names and types against a notebook's `parameters` cell; this module checks the
values (ranges, choices, memory needed where the sizes say it) with the same validators the
workloads apply when they run, so a bad value is refused with exit 2 while planning instead of
failing a minute later inside a kernel. Notebooks not listed here (test fixtures, new notebooks)
get the runner's name and type checks only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

import numpy as np

from benchlib.engines import ENGINE_NAMES

# The memory a notebook may plan to use: sizes above this share of the available memory are refused.
MEMORY_HEADROOM = 0.9
MNIST_SAMPLES = 60_000  # the training split, when real digits are found
MNIST_PIXELS = 28 * 28
INJECTED = ("device", "results_dir")  # set by the runner, not part of a config


class ParameterError(ValueError):
    """A notebook parameter's value that its workload refuses; the message says what is valid."""


def _positive_int(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def _int_list(name: str, values: Any, least: int = 1) -> list[int]:
    if isinstance(values, (str, int)) or not isinstance(values, Iterable) or not list(values):
        raise ValueError(f"{name} must be a non-empty list of integers >= {least}, got {values!r}")
    return [_positive_int(f"each of {name}", value, least) for value in values]


def _choices(name: str, values: Any, valid: Iterable[str]) -> list[str]:
    valid = tuple(valid)
    if isinstance(values, str) or not isinstance(values, Iterable) or not list(values):
        raise ValueError(f"{name} must be a non-empty list drawn from {', '.join(valid)}, got {values!r}")
    unknown = [value for value in values if value not in valid]
    if unknown:
        raise ValueError(f"unknown {name} {unknown}; valid: {', '.join(valid)}")
    return list(values)


def _fits(required_bytes: int, device: Any, what: str) -> None:
    """Refuse sizes whose memory need exceeds what the device has available now, with both numbers."""
    if device is None:
        return
    from benchlib.measure.isolation import available_memory

    available = available_memory(device)
    if required_bytes > MEMORY_HEADROOM * available:
        raise ValueError(
            f"{what} needs about {required_bytes / 1e9:.2f} GB, but {available / 1e9:.2f} GB are available on "
            f"{device.name} ({MEMORY_HEADROOM:.0%} may be planned); choose smaller sizes")


def _engine_comparison(params: Mapping[str, Any]) -> list[str]:
    from benchlib.engines.comparison import validate_common
    from benchlib.measure.isolation import malloc_environment

    engines = validate_common(dtype=params["dtype"], engines=params["engines"], repeats=params["repeats"],
                              warmup=params["warmup"], trials=params["trials"])
    malloc_environment(params["malloc"])
    return engines


def _dot_chain(params: Mapping[str, Any], device: Any) -> None:
    from benchlib.workloads.dot_chain import memory_required_bytes

    engines = _engine_comparison(params)
    D, depth = _positive_int("D", params["D"]), _positive_int("depth", params["depth"])
    _fits(max(memory_required_bytes(engine, D, depth, params["dtype"]) for engine in engines), device,
          f"the dot chain at D={D}, depth={depth}, {params['dtype']}")


def _rnn_fanout(params: Mapping[str, Any], device: Any) -> None:
    from benchlib.workloads.rnn import MODELS, memory_required_bytes

    if params["model"] not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {params['model']!r}")
    engines = _engine_comparison(params)
    batch, hidden = _positive_int("batch", params["batch"]), _positive_int("hidden", params["hidden"])
    steps = [_positive_int("T", params["T"]), *_int_list("T_sweep", params["T_sweep"])]
    _fits(max(memory_required_bytes(engine, batch, hidden, max(steps), params["dtype"]) for engine in engines),
          device, f"the RNN at batch={batch}, hidden={hidden}, T={max(steps)}, {params['dtype']}")


def _checkpointing(params: Mapping[str, Any], device: Any) -> None:
    from benchlib.workloads.checkpointing import ENGINES, check_budgets
    from benchlib.workloads.dot_chain import memory_required_bytes

    _engine_comparison({**params, "engines": ENGINES})
    D, depth = _positive_int("D", params["D"]), _positive_int("depth", params["depth"])
    check_budgets(params["budgets"], depth)
    _fits(memory_required_bytes("manual", D, depth, params["dtype"]), device,
          f"the dot chain at D={D}, depth={depth}, {params['dtype']}")


def _identical_closures(params: Mapping[str, Any], device: Any) -> None:
    from benchlib.workloads.closures import validate

    validate(**{name: params[name] for name in ("mwes", "engines", "orders", "warmup", "repeats", "cold_passes",
                                                "alloc_passes", "alloc_samples", "backend")}, seed=0)
    if not 0 < params["alpha"] < 1:
        raise ValueError(f"alpha must be between 0 and 1, got {params['alpha']!r}")
    if params["min_effect"] < 0:
        raise ValueError(f"min_effect must be >= 0, got {params['min_effect']!r}")


def _mnist_ensembles(params: Mapping[str, Any], device: Any) -> None:
    from benchlib.workloads.ensembles import GC_POLICIES, STRATEGIES
    from benchlib.workloads.lenet import MODES

    for name in ("synthetic_n", "n_nets", "hidden", "batch", "steps", "per_net_steps", "manual_every",
                 "pause_repeats", "lenet_epochs", "trials"):
        _positive_int(name, params[name])
    for name in ("warmup", "alloc_steps", "lenet_step_limit", "torch_threads", "seed"):
        _positive_int(name, params[name], least=0)
    for name in ("steps", "per_net_steps"):
        if params[name] <= params["warmup"]:
            raise ValueError(f"{name} ({params[name]}) must exceed warmup ({params['warmup']})")
    if params["manual_generation"] not in (0, 1, 2):
        raise ValueError(f"manual_generation must be 0, 1 or 2, got {params['manual_generation']!r}")
    _choices("strategies", params["strategies"], STRATEGIES)
    _choices("gc_policies", params["gc_policies"], GC_POLICIES)
    _choices("cycle_strategies", params["cycle_strategies"], STRATEGIES)
    _choices("lenet_modes", params["lenet_modes"], MODES)
    heap_sizes = _int_list("heap_sizes", params["heap_sizes"], least=0)
    pause_heap_sizes = _int_list("pause_heap_sizes", params["pause_heap_sizes"], least=0)
    cycles = _int_list("cycles", params["cycles"], least=0)
    _int_list("thread_counts", params["thread_counts"])
    samples = max(params["synthetic_n"], MNIST_SAMPLES)  # real digits or the synthetic set, whichever loads
    # Uncollected cycles may hold every step's batch and its standardised copies at once (raised thresholds).
    held_by_cycles = ((max(cycles) + 1) * params["batch"] * MNIST_PIXELS * 4
                      * max(params["steps"], params["per_net_steps"]))
    # The images as float32 tensors (plus a uint8 copy while loading), the long-lived heap's tuples.
    _fits(samples * (MNIST_PIXELS * 5 + 16) + max(heap_sizes + pause_heap_sizes) * 200 + held_by_cycles, device,
          f"mnist_ensembles with {samples} samples")


def _calibration(params: Mapping[str, Any], device: Any) -> None:
    sizes = _int_list("matmul_sizes_cuda" if getattr(device, "is_cuda", False) else "matmul_sizes_cpu",
                      params["matmul_sizes_cuda" if getattr(device, "is_cuda", False) else "matmul_sizes_cpu"])
    _int_list("matmul_sizes_cpu", params["matmul_sizes_cpu"])
    _int_list("matmul_sizes_cuda", params["matmul_sizes_cuda"])
    copy_mib = _positive_int("copy_mib", params["copy_mib"])
    intervals = params["sampler_intervals_s"]
    if isinstance(intervals, str) or not list(intervals) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in intervals):
        raise ValueError(f"sampler_intervals_s must be a non-empty list of positive seconds, got {intervals!r}")
    _positive_int("rounds", params["rounds"])
    _positive_int("repeats", params["repeats"])
    itemsize = np.dtype("float64").itemsize
    _fits(max(3 * max(sizes) ** 2 * itemsize, 2 * copy_mib * 2**20), device, "the calibration sizes")


@dataclass(frozen=True)
class NotebookConfig:
    """A notebook's parameters (those of its `parameters` cell the runner does not inject): the
    one place their defaults live. Built once at the entry point, checked by the workload's rules
    there (`ParameterError`), trusted below; `check(device)` adds the memory the sizes need."""

    notebook = ""

    def __post_init__(self):
        self.check(None)

    def check(self, device: Any) -> None:
        try:
            CHECKS[self.notebook](asdict(self), device)
        except ValueError as error:
            raise ParameterError(f"{self.notebook}: {error}") from None

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> "NotebookConfig":
        """The config from a notebook's parameter values; names the runner injects are left out."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - names - set(INJECTED))
        if unknown:
            raise ParameterError(f"{cls.notebook}: unknown parameter(s) {unknown}; valid: {', '.join(sorted(names))}")
        return cls(**{name: value for name, value in params.items() if name in names})

    @classmethod
    def from_namespace(cls, namespace: Mapping[str, Any]) -> "NotebookConfig":
        """The config from a notebook's variables (``globals()`` after its parameters cell): its fields only."""
        return cls.from_parameters({f.name: namespace[f.name] for f in fields(cls) if f.name in namespace})


def _config(notebook: str, **defaults: Any) -> type[NotebookConfig]:
    """A frozen config class for `notebook` whose fields and defaults are `defaults` (lists as tuples)."""
    specs = [(name, tuple, field(default_factory=lambda value=tuple(value): value))
             if isinstance(value, (list, tuple)) else (name, type(value), value) for name, value in defaults.items()]
    name = "".join(part.title() for part in notebook.split("_")) + "Config"
    return make_dataclass(name, specs, bases=(NotebookConfig,), frozen=True,
                          namespace={"notebook": notebook, "__module__": __name__})


_COMPARISON = dict(engines=ENGINE_NAMES, malloc="mmap-128k")  # the gradient-engine notebooks' shared settings
DotChainConfig = _config("dot_chain", dtype="float64", D=1000, depth=100, repeats=1, trials=3, warmup=0, **_COMPARISON)
RnnFanoutConfig = _config("rnn_fanout", dtype="float32", model="bench_rnn", batch=16, hidden=1024, T=50,
                          T_sweep=[25, 50, 100, 200], repeats=3, trials=3, warmup=1, **_COMPARISON)
# checkpointing's engines are fixed (manual and benchlib-checkpoint), so they are no parameter there
CheckpointingConfig = _config("checkpointing", dtype="float64", D=500, depth=100, budgets=[2, 3, 5, 10, 20, 50, 100],
                              repeats=1, trials=3, warmup=0, malloc="mmap-128k")
IdenticalClosuresConfig = _config(
    "identical_closures", mwes=["dense", "reduced"], orders=["seed", "reversed"], warmup=3, repeats=30,
    engines=["benchlib-inplace", "autograd", "torch", "torch.compile", "torch.func"], cold_passes=5, alloc_passes=2,
    alloc_samples=2, backend="inductor", alpha=0.01, min_effect=0.05)
MnistEnsemblesConfig = _config(
    "mnist_ensembles", data_dir="", download=True, synthetic_n=60000, n_nets=200, hidden=6, batch=64, steps=200,
    per_net_steps=20, warmup=5, alloc_steps=1, manual_every=10, manual_generation=2, pause_repeats=5,
    strategies=["naive", "buffers_reused", "step_in_backward", "batched_vmap", "batched_hand"],
    gc_policies=["default", "freeze", "thresholds", "manual"], heap_sizes=[0, 60000],
    pause_heap_sizes=[0, 30000, 60000, 120000], cycles=[0, 20], cycle_strategies=["naive", "batched_hand"],
    lenet_modes=["sequential", "threads", "vmap"], lenet_epochs=2, lenet_step_limit=20, torch_threads=0,
    thread_counts=[1, 2], trials=3, seed=0)
CalibrationConfig = _config("calibration", matmul_sizes_cpu=[128, 512, 1024], matmul_sizes_cuda=[1024, 4096, 8192],
                            copy_mib=256, sampler_intervals_s=[0.001, 0.002, 0.01], rounds=11, repeats=5)


CONFIGS: dict[str, type[NotebookConfig]] = {cls.notebook: cls for cls in (
    CalibrationConfig, CheckpointingConfig, DotChainConfig, RnnFanoutConfig, IdenticalClosuresConfig,
    MnistEnsemblesConfig)}


CHECKS: dict[str, Callable[[Mapping[str, Any], Any], None]] = {
    "calibration": _calibration,
    "checkpointing": _checkpointing,
    "dot_chain": _dot_chain,
    "rnn_fanout": _rnn_fanout,
    "identical_closures": _identical_closures,
    "mnist_ensembles": _mnist_ensembles,
}


def validate_parameters(notebook: str, params: Mapping[str, Any]) -> NotebookConfig | None:
    """Check a notebook's full parameter set (defaults with overrides) by its workload's rules: its
    config built once (`CONFIGS`), then the memory its sizes need on the device `params["device"]`
    names (the runner passes the resolved one; without it the memory checks are skipped).

    Raises ParameterError naming the notebook, the parameter and what is valid; a notebook without
    a config here (test fixtures, new notebooks) passes and gets None.
    """
    config_class = CONFIGS.get(notebook)
    if config_class is None:
        return None
    device = None
    if params.get("device"):
        from benchlib.measure import DeviceError, resolve_device

        try:
            device = resolve_device(params["device"])
        except DeviceError as error:
            raise ParameterError(f"{notebook}: device {params['device']!r}: {error}") from None
    try:
        config = config_class.from_parameters(params)
    except TypeError as error:  # a parameter the config requires is missing
        raise ParameterError(f"{notebook}: {error}") from None
    config.check(device)
    return config
