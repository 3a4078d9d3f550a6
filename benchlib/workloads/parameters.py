"""Each benchmark notebook's parameter values checked by its workload's own rules, before any kernel starts.

The runner checks names and types against a notebook's `parameters` cell; this module checks the
values (ranges, choices, memory needed where the sizes say it) with the same validators the
workloads apply when they run, so a bad value is refused with exit 2 while planning instead of
failing a minute later inside a kernel. Notebooks not listed here (test fixtures, new notebooks)
get the runner's name and type checks only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

# The memory a notebook may plan to use: sizes above this share of the available memory are refused.
MEMORY_HEADROOM = 0.9
MNIST_SAMPLES = 60_000  # the training split, when real digits are found
MNIST_PIXELS = 28 * 28


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
                              warmup=params["warmup"])
    malloc_environment(params["malloc"])
    return engines


def _dot_chain(params: Mapping[str, Any], device: Any) -> None:
    from benchlib.workloads.dot_chain import memory_required_bytes

    engines = _engine_comparison(params)
    D, depth = _positive_int("D", params["D"]), _positive_int("depth", params["depth"])
    _fits(max(memory_required_bytes(engine, D, depth, params["dtype"]) for engine in engines), device,
          f"the dot chain at D={D}, depth={depth}, {params['dtype']}")


def _rnn_fanout(params: Mapping[str, Any], device: Any) -> None:
    from benchlib.workloads.rnn import memory_required_bytes

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
                 "pause_repeats", "lenet_epochs"):
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
    _choices("lenet_modes", params["lenet_modes"], MODES)
    heap_sizes = _int_list("heap_sizes", params["heap_sizes"], least=0)
    _int_list("thread_counts", params["thread_counts"])
    samples = max(params["synthetic_n"], MNIST_SAMPLES)  # real digits or the synthetic set, whichever loads
    if max(heap_sizes) > samples:
        raise ValueError(f"heap_sizes may hold at most the {samples} samples, got {max(heap_sizes)}")
    # The images as float32 tensors (plus a uint8 copy while loading), the long-lived heap's tuples.
    _fits(samples * (MNIST_PIXELS * 5 + 16) + max(heap_sizes) * 200, device,
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


CHECKS: dict[str, Callable[[Mapping[str, Any], Any], None]] = {
    "calibration": _calibration,
    "checkpointing": _checkpointing,
    "dot_chain": _dot_chain,
    "rnn_fanout": _rnn_fanout,
    "identical_closures": _identical_closures,
    "mnist_ensembles": _mnist_ensembles,
}


def validate_parameters(notebook: str, params: Mapping[str, Any]) -> None:
    """Check a notebook's full parameter set (defaults with overrides) by its workload's rules.

    The memory checks run against the device `params["device"]` names (the runner passes the
    resolved one); without it they are skipped. Raises ParameterError naming the
    notebook, the parameter and what is valid; a notebook without rules here passes.
    """
    check = CHECKS.get(notebook)
    if check is None:
        return
    device = None
    if params.get("device"):
        from benchlib.measure import DeviceError, resolve_device

        try:
            device = resolve_device(params["device"])
        except DeviceError as error:
            raise ParameterError(f"{notebook}: device {params['device']!r}: {error}") from None
    try:
        check(params, device)
    except KeyError as missing:
        raise ParameterError(f"{notebook}: its parameters cell has no {missing.args[0]!r}, which its checks need") from None
    except ValueError as error:
        raise ParameterError(f"{notebook}: {error}") from None
