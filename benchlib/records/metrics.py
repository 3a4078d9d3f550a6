"""The metric registry: every metric a record may carry, with its unit, kind and meaning.

`make_record` checks each record's metric here, so a typo or a unit that disagrees fails in the
workload that made it. This module holds the metrics every benchmark shares (a measurement's,
the CUDA allocator's, allocation sites', case outcomes and gradient checks, memory by role); a
benchmark declares its own (`Benchmark(metrics=...)`), registered by `Benchmark.register`.
Store raw values: a median, a ratio or a share that can be computed from stored values is
derived when read (`benchlib.analysis`, `benchlib.report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from benchlib.errors import Refused

TRIALS_RUN = "trials_run"  # the record of how many trials a case ran; params.stop says why (benchlib.trials)
# Recorded (value 1, the reason in params["message"]) for an engine that ran but whose gradient could not be
# compared (benchlib.trials): no reference gradient, or a stochastic step drawn differently
GRAD_UNCHECKED_METRIC = "grad_check_unavailable"
GRAD_ERROR_METRIC = "grad_max_rel_err"  # max|g - g_reference| / max|g_reference| (benchlib.engines.gradients)
COMPILE_METRIC = "compile_time"  # a compiling engine's first call, made in the set-up (never a measured call)
COMPILE_COLUMN = "compile_s"  # its median over trials in a summary table
GATHERED_METRIC = "role_gathered_bytes"  # a sharded rank's parameters gathered whole as its blocks run (FSDP2)
COMMUNICATION_METRIC = "communication_share"  # a rank's share of one step with a collective in flight (torch.profiler)
RANK_PREFIX = "rank_"  # a step on several ranks: every rank's own figure is `rank_<metric>` (params: rank, world_size)
MODULE_METRIC = "module_bytes"  # a model's memory by module path (params: `module`, `role`; benchlib.engines.module_memory)
SAVED_ROLE, GRADIENT_ROLE = "saved", "gradients"  # the roles a step allocates: columns of a role timeline
PARAMETER_ROLE, OPTIMIZER_ROLE = "parameters", "optimizer"  # the roles held before a step
# Where an isolated trial's time went (benchlib.measure: the child times its phases, the parent the rest):
# the instrument's own cost beside what it measured. Each phase is a metric of its own, `harness_<phase>_time`.
HARNESS_PHASES = {
    "process": "starting the case's process (fork from the warm template, or a fresh interpreter), preloading "
               "and handing over spec and result, and its exit: the trial's wall time less its other phases",
    "setup": "importing the case's module and building what it measures (the model, the batch, the engine)",
    "warmup": "the warm-up calls",
    "timed": "the timed calls: what the figures are made of",
    "allocation_pass": "the traced call that counts allocations (memray, or the CUDA caching allocator's counters)",
    "attribution_pass": "the traced call that attributes the peak to source lines, and reading its records (--attribute)",
    "check": "the case's check after the measured calls (a gradient saved, the tape's counters, memory by role)",
    "role_pass": "the one more call sampled with the engine's role gauge (the first trial of an engine comparison, "
                 "where the gauge hooks into the engine or the trial makes several measured calls)",
    "snapshot": "the one more step under the CUDA caching allocator's history (a model file on CUDA, first trial)",
}


def harness_metric(phase: str) -> str:
    """The metric of one phase of an isolated trial (`HARNESS_PHASES`)."""
    if phase not in HARNESS_PHASES:
        raise MetricError(f"unknown harness phase {phase!r}; the phases are {', '.join(HARNESS_PHASES)}")
    return f"harness_{phase}_time"

KINDS = ("time", "memory", "count", "rate", "ratio", "loss", "check", "status", "setting")
UNITS = ("s", "B", "count", "", "ratio", "B/s", "FLOP/s", "model-samples/s")


class MetricError(Refused):
    """A metric that is not registered, or a unit that is not its registered unit."""


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    kind: str
    meaning: str
    better: str | None = None  # "lower" or "higher" where not its unit's way (a largest fitting value: higher)


def checked_metric(name: str, unit: str, kind: str, meaning: str, better: str | None = None) -> Metric:
    """The `Metric` these facts declare, or a MetricError saying which fact is invalid: a declaration is checked when
    made, before anything registers it."""
    if better not in (None, "lower", "higher"):
        raise MetricError(f"better of {name!r} must be 'lower', 'higher' or None (its unit's way), got {better!r}")
    if unit not in UNITS:
        raise MetricError(f"unit of {name!r} must be one of {UNITS}, got {unit!r}")
    if kind not in KINDS:
        raise MetricError(f"kind of {name!r} must be one of {', '.join(KINDS)}, got {kind!r}")
    return Metric(name, unit, kind, meaning, better)


class MetricRegistry:
    """Metric name -> `Metric`; registering a name twice with different facts is refused."""

    def __init__(self):
        self._metrics: dict[str, Metric] = {}

    def register(self, name: str, unit: str, kind: str, meaning: str, better: str | None = None) -> Metric:
        metric = checked_metric(name, unit, kind, meaning, better)
        known = self._metrics.get(name)
        if known is not None and known != metric:
            raise MetricError(f"metric {name!r} is already registered as {known}")
        self._metrics[name] = metric
        return metric

    def __contains__(self, name: object) -> bool:
        return name in self._metrics

    def __getitem__(self, name: str) -> Metric:
        if name not in self._metrics:
            raise MetricError(f"unknown metric {name!r}: declare it with its benchmark (Benchmark(metrics=((name, unit, "
                              f"kind, meaning), ...))); known: {', '.join(sorted(self._metrics))}")
        return self._metrics[name]

    def __iter__(self):
        return iter(self._metrics.values())

    def unit_of(self, name: str, unit: str | None = None) -> str:
        """The registered unit of `name`; a `unit` given must be that one."""
        metric = self[name]
        if unit is not None and unit != metric.unit:
            raise MetricError(f"metric {name!r} is in {metric.unit!r}, got unit {unit!r}")
        return metric.unit


METRICS = MetricRegistry()
# The caching allocator's own view of the timed calls (benchlib.measure.devices.Device.allocator_view; CUDA only)
CUDA_RESERVED_PEAK = "cuda_reserved_peak_bytes"
CUDA_RESERVED_UNUSED = "cuda_reserved_unused_bytes"
CUDA_MALLOC_COUNT = "cuda_malloc_count"
CUDA_ALLOC_RETRIES = "cuda_alloc_retries"

for _name, _unit, _kind, _meaning in (
    # benchlib.measure.Measurement
    ("time", "s", "time", "one timed call (repeat = which call)"),
    ("gc_count", "count", "count", "GC collections that began in the timed calls"),
    ("gc_time", "s", "time", "seconds of GC pauses in the timed calls"),
    ("alloc_count", "count", "count", "allocations of one traced call (memray, or the CUDA caching allocator): memray's "
     "records made under the call's frame, or by threads with no Python frame, less the tracker's floor (params.floor: "
     "an empty Python function's count, measured in the same session); the raw count is value + params.floor"),
    ("alloc_bytes", "B", "memory", "bytes of the call's allocations (the same records; the floor is not subtracted)"),
    ("alloc_count_python", "count", "count", "Python-allocator allocations of one traced call (memray; overlaps "
     "alloc_count): records made under the call's frame less the floor (params.floor; raw = value + params.floor); "
     "they include the frame objects tracing makes CPython create (docs/measuring.md)"),
    ("alloc_bytes_python", "B", "memory", "bytes of those Python-allocator allocations (the floor is not subtracted)"),
    ("peak_bytes", "B", "memory", "peak memory above the baseline over the timed calls"),
    ("tracked_peak_bytes", "B", "memory", "most bytes live at once in the allocation pass, as the allocators saw them "
     "(memray on CPU, the caching allocator on CUDA): the same for a given code path, unlike the resident peak"),
    ("baseline_bytes", "B", "memory", "memory in use just before the first timed call"),
    (CUDA_RESERVED_PEAK, "B", "memory", "the caching allocator's reserved peak over the timed calls, absolute "
     "(what an out-of-memory error is about: tensors plus the cache and its block rounding)"),
    (CUDA_RESERVED_UNUSED, "B", "memory", "reserved peak minus allocated peak: bytes reserved but holding no "
     "tensor at the peak (fragmentation and rounding; an upper bound where the two peaks fall apart in time)"),
    (CUDA_MALLOC_COUNT, "count", "count", "segments the caching allocator took from the driver in the timed calls "
     "(one cudaMalloc each; 0 once its cache holds a step)"),
    (CUDA_ALLOC_RETRIES, "count", "count", "times a cudaMalloc failed in the timed calls and the allocator freed its "
     "cache to retry (fragmentation under memory pressure: each retry synchronises the device)"),
    # allocation sites (benchlib.analysis.sites; an attribution pass, --attribute)
    ("site_bytes", "B", "memory", "bytes one source line accounts for in an attribution pass (repeat = its rank): "
     "live at the pass's peak (params.kind peak), freed soon after being made (temporary) or allocated in all "
     "(allocated); params.site is file:line, params.function its function, params.own whether it is the user's code"),
    ("site_count", "count", "count", "allocations of that site and kind (the same params as its site_bytes)"),
    ("site_bytes_diff", "B", "memory", "a site's bytes in stream b minus stream a (params.a, params.b; params.of the "
     "kind of site compared; kind diff)"),
    ("site_count_diff", "count", "count", "a site's allocations in stream b minus stream a (as site_bytes_diff)"),
    ("attribution_call_time", "s", "time", "the traced call of an attribution pass (its cost, beside a plain call)"),
    ("attribution_read_time", "s", "time", "stopping the attribution pass's tracker and reading and grouping its records"),
    ("attribution_peak_bytes", "B", "memory", "most bytes live at once in the attribution pass, as its tracer saw them "
     "(the system allocator only, unless params.python_allocators)"),
    ("attribution_unattributed_bytes", "B", "memory", "bytes of that peak whose stacks held no Python frame "
     "(native threads, memory allocated before any Python frame)"),
    # torch.profiler's categories at torch's peak (benchlib.measure.torch_categories; torch engines, --attribute)
    *[(f"torch_{name}_bytes", "B", "memory", f"torch.profiler's {name.replace('_', ' ')} category at the moment its "
       "categories sum highest in one step (beside benchlib's roles; docs/measuring.md)")
      for name in ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
                   "unknown")],
    ("torch_peak_bytes", "B", "memory", "the sum of torch.profiler's categories at that moment: torch's peak"),
    (TRIALS_RUN, "count", "setting", "trials a case ran before it stopped; params.stop says why (precision: its "
     "peak's 95% interval within params.precision of the median; deterministic: identical trials; max_trials: the "
     "cap; budget: the time --budget left), params.precision_reached the relative half-width it reached"),
    # case outcomes and checks
    ("ok", "", "status", "the case ran (value 1)"),
    ("failed", "", "status", "the case failed; params.message holds the error (value 1)"),
    ("not_applicable", "", "status", "the case cannot run here; params.message says why (value 1)"),
    ("not_run", "", "status", "the case was not run; params.message says why, e.g. the budget ran out (value 1)"),
    (COMPILE_METRIC, "s", "time", "torch.compile's first forward and backward, which trace and compile the "
                                  "step: in the set-up, never in a measured call (later trials may find torch's "
                                  "compile cache warm)"),
    ("grad_max_rel_err", "", "check", "max |g - g_reference| / max |g_reference| of a gradient"),
    ("grad_worst_array_rel_err", "", "check", "a gradient computed in half precision, array by array: the largest "
     "max |g_i - g_reference_i| / max(max |g_reference_i|, unit roundoff x max |g_reference|) (over 0.5: an array "
     "lost, benchlib.engines.gradients.LOST_ARRAY)"),
    (GRAD_UNCHECKED_METRIC, "", "status", "no reference gradient to compare with, or none it can be compared with "
     "(not comparable: a stochastic step drawn differently); params.message says why"),
    ("update_max_rel_err", "", "check", "max |u - u_reference| / max |u_reference| of the update the optimizer's "
     "step made to the parameters (after minus before; model files with an optimizer): the same step, not only the "
     "same gradient"),
    ("grad_seed_dependent", "", "check", "1 when the reference's own gradient changes with the random seed (the "
     "step draws random numbers, e.g. dropout), else 0"),
    # memory by role (benchlib.engines.roles; the tape's engines, torch's saved-tensor hooks, model files)
    ("role_saved_bytes", "B", "memory", "forward values held for the backward pass: at the tape's peak (benchlib), "
                                        "or packed by torch's saved-tensor hooks in one call (torch)"),
    ("role_gradient_bytes", "B", "memory", "gradient buffers at the tape's peak (benchlib engines)"),
    (GATHERED_METRIC, "B", "memory", "a sharded rank's parameters gathered whole from every rank's shard (FSDP2's "
     "unsharded parameters, each block's from its all-gather until it is resharded), at their most in one step"),
    (COMMUNICATION_METRIC, "", "time", "the share of a rank's step (0-1) during which a collective (all-reduce, "
     "all-gather, reduce-scatter) was in flight, waiting for other ranks included: one more step after the measured "
     "ones, under torch.profiler (its gloo:/nccl: events); the worst rank's"),
    *[(f"{RANK_PREFIX}{name}", unit, kind, f"{meaning}: one rank's (params.rank of params.world_size); a step on "
       "several ranks records its worst rank (the most held: baseline and peak) under the plain name") for name, unit, kind, meaning in (
        ("peak_bytes", "B", "memory", "peak memory of one step, above its baseline"),
        ("baseline_bytes", "B", "memory", "memory held before its steps (the model's share, optimizer state)"),
        ("time", "s", "time", "median time of one step"),
        ("role_parameter_bytes", "B", "memory", "parameters held (a shard's local bytes)"),
        ("role_optimizer_bytes", "B", "memory", "optimizer state held (a shard's local bytes)"),
        ("role_gradient_bytes", "B", "memory", "gradients at their most"),
        ("role_saved_bytes", "B", "memory", "saved activations at their most"),
        (GATHERED_METRIC, "B", "memory", "parameters gathered whole as its blocks run, at their most"),
        (COMMUNICATION_METRIC, "", "time", "the share of one step with a collective in flight"))],
    (MODULE_METRIC, "B", "memory", "bytes a module path holds in one role (params: module, role), each role's at its "
                                   "own most: parameters, optimizer state, gradients, saved activations"),
    *[(harness_metric(phase), "s", "time", f"one trial's seconds, {meaning} (params.trial says which)")
      for phase, meaning in HARNESS_PHASES.items()],
):
    METRICS.register(_name, _unit, _kind, _meaning)
