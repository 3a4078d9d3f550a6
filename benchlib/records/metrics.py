"""The metric registry: every metric a record may carry, with its unit, kind and meaning.

`make_record` checks each record's metric here, so a typo or a unit that disagrees fails in the
workload that made it. A new metric is one `METRICS.register(...)` line (in this module for the
workbench's own; a workload outside it may register its own at import). Store raw values: a
median, a ratio or a share that can be computed from stored values is derived in `results`.
"""

from __future__ import annotations

from dataclasses import dataclass

TRIALS_RUN = "trials_run"  # the record of how many trials a case ran; params.stop says why (benchlib.trials)
# Recorded (value 1, the reason in params["message"]) for an engine that ran but whose gradient could not be
# compared (benchlib.trials): no reference gradient, or a stochastic step drawn differently
GRAD_UNCHECKED_METRIC = "grad_check_unavailable"
KINDS = ("time", "memory", "count", "rate", "ratio", "loss", "check", "status", "setting")
UNITS = ("s", "B", "count", "", "ratio", "B/s", "FLOP/s", "model-samples/s")


class MetricError(ValueError):
    """A metric that is not registered, or a unit that is not its registered unit."""


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    kind: str
    meaning: str


class MetricRegistry:
    """Metric name -> `Metric`; registering a name twice with different facts is refused."""

    def __init__(self):
        self._metrics: dict[str, Metric] = {}

    def register(self, name: str, unit: str, kind: str, meaning: str) -> Metric:
        if unit not in UNITS:
            raise MetricError(f"unit of {name!r} must be one of {UNITS}, got {unit!r}")
        if kind not in KINDS:
            raise MetricError(f"kind of {name!r} must be one of {', '.join(KINDS)}, got {kind!r}")
        metric = Metric(name, unit, kind, meaning)
        known = self._metrics.get(name)
        if known is not None and known != metric:
            raise MetricError(f"metric {name!r} is already registered as {known}")
        self._metrics[name] = metric
        return metric

    def __contains__(self, name: object) -> bool:
        return name in self._metrics

    def __getitem__(self, name: str) -> Metric:
        if name not in self._metrics:
            raise MetricError(f"unknown metric {name!r}: register it in benchlib.records.metrics "
                              f"(METRICS.register(name, unit, kind, meaning)); known: {', '.join(sorted(self._metrics))}")
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
    # `benchlib fit` (benchlib.usermodel.fit): the largest value of a parameter under a memory limit
    ("fit_total_bytes", "B", "memory", "total memory of one step at params.value of the parameter params.scale: on CUDA "
     "the allocator's reserved peak, on the CPU the process's resident high-water mark (params.total says which)"),
    ("predicted_total_bytes", "B", "memory", "the size model's total at params.value (params.model: linear or quadratic)"),
    ("fit_check_error", "ratio", "check", "relative error of the size model, fitted to the smaller points, at the "
     "largest measured one: how far its extrapolation was off where it could be checked"),
    ("max_fitting", "", "setting", "the largest value of params.scale whose predicted total stays under params.limit "
     "bytes (0: not even the smallest value measured)"),
    ("fit_verify_error", "ratio", "check", "(predicted - measured) / measured total at the largest fitting value, "
     "measured for real (`benchlib fit --verify`; params.predicted, params.measured)"),
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
    ("grad_max_rel_err", "", "check", "max |g - g_reference| / max |g_reference| of a gradient"),
    (GRAD_UNCHECKED_METRIC, "", "status", "no reference gradient to compare with, or none it can be compared with "
     "(not comparable: a stochastic step drawn differently); params.message says why"),
    ("update_max_rel_err", "", "check", "max |u - u_reference| / max |u_reference| of the update the optimizer's "
     "step made to the parameters (after minus before; model files with an optimizer): the same step, not only the "
     "same gradient"),
    ("grad_seed_dependent", "", "check", "1 when the reference's own gradient changes with the random seed (the "
     "step draws random numbers, e.g. dropout), else 0"),
    ("grads_identical", "", "check", "1 when two gradients are bit-identical, else 0"),
    ("x_scale", "", "setting", "scale applied to the dot chain's input so its values stay finite"),
    # checkpointing
    ("role_saved_bytes", "B", "memory", "forward values held for the backward pass: at the tape's peak (benchlib), "
                                        "or packed by torch's saved-tensor hooks in one call (torch)"),
    ("role_gradient_bytes", "B", "memory", "gradient buffers at the tape's peak (benchlib engines)"),
    ("recomputed_nodes", "count", "count", "tape nodes recomputed in one checkpointed backward pass"),
    ("saved_bytes_peak", "B", "memory", "peak bytes of saved activations on the checkpointed tape"),
    ("peak_total_bytes", "B", "memory", "peak bytes held by the checkpointed tape, snapshots included"),
    ("revolve_recomputations", "count", "count", "recomputations Revolve predicts for the same chain and budget"),
    # calibration
    ("flop_rate", "FLOP/s", "rate", "matrix-product floating-point operations per second"),
    ("bandwidth", "B/s", "rate", "bytes read plus written per second by a copy"),
    ("time_plain", "s", "time", "one call without the instrument under calibration"),
    ("time_instrumented", "s", "time", "one call with the instrument under calibration"),
    ("time_ratio", "ratio", "ratio", "median instrumented time / median plain time"),
    ("time_ratio_min", "ratio", "ratio", "fastest instrumented time / fastest plain time"),
    ("sample_time", "s", "time", "one memory read of the timeline sampler"),
    # mnist_ensembles: per step and per cell
    ("step_time", "s", "time", "one training step (repeat = step index; warm-up steps included)"),
    ("step_gc_pauses", "count", "count", "GC collections that began in one step"),
    ("step_gc_time", "s", "time", "seconds of GC pauses in one step"),
    ("step_loss", "", "loss", "mean loss over the nets in one step"),
    ("step_time_median", "s", "time", "median step time after warm-up"),
    ("step_time_p99", "s", "time", "99th percentile step time after warm-up"),
    ("step_time_max", "s", "time", "slowest step after warm-up"),
    ("throughput", "model-samples/s", "rate", "samples times nets trained per second after warm-up"),
    ("gc_share", "", "ratio", "share of the timed seconds spent in GC pauses"),
    ("gc_pauses", "count", "count", "GC collections after warm-up"),
    ("step_gc_time_max", "s", "time", "longest GC time of one step after warm-up"),
    ("step_memory_max", "B", "memory", "highest memory in use after a step, after warm-up, above the cell's start"),
    ("cycle_bytes_max", "B", "memory", "most bytes uncollected reference cycles held after a step, after warm-up"),
    ("alloc_count_per_step", "count", "count", "allocations per step (a separate traced pass of several steps, less the "
     "tracker's floor, over its steps)"),
    ("alloc_bytes_per_step", "B", "memory", "bytes allocated per step (a separate traced pass)"),
    ("alloc_count_python_per_step", "count", "count", "Python-allocator allocations per step (the same traced pass, "
     "less the floor, over its steps)"),
    ("alloc_bytes_python_per_step", "B", "memory", "bytes of those Python-allocator allocations per step"),
    ("final_loss", "", "loss", "mean loss over the nets at the last step"),
    ("gc_pause_time", "s", "time", "one collection's pause (repeat = the pause's index in its cell or case)"),
    ("gc_pause_generation", "count", "count", "the generation one collection collected (repeat = pause index)"),
    ("gc_pause_collected", "count", "count", "unreachable objects one collection freed (repeat = pause index)"),
    ("gc_pause_uncollectable", "count", "count", "objects one collection found but could not free (repeat = pause index)"),
    ("gc_pause_tracked", "count", "count", "tracked objects one collection walked: its generation and the younger ones (repeat = pause index)"),
    ("gc_pause_step", "count", "count", "the training step in which one collection began (repeat = pause index)"),
    ("step_memory", "B", "memory", "memory in use after one step above the cell's start (RSS on CPU, allocated on CUDA; repeat = step index)"),
    ("step_cycle_bytes", "B", "memory", "bytes of step tensors held by reference cycles not yet collected, after one step (repeat = step index)"),
    ("floor_step_s", "s", "time", "FLOP floor of one ensemble step at the measured FLOP rate"),
    ("ceiling_model_samples_per_s", "model-samples/s", "rate", "throughput ceiling at the measured FLOP rate"),
    # mnist_ensembles: LeNet5 epochs
    ("epoch_time", "s", "time", "one epoch (repeat = epoch)"),
    ("epoch_gc_time", "s", "time", "seconds of GC pauses in one epoch"),
    ("epoch_gc_pauses", "count", "count", "GC collections in one epoch"),
    ("epoch_loss", "", "loss", "mean loss of the models over the epoch's last step"),
    ("epoch_alloc_count_est", "count", "count", "allocations per step (traced pass) times the epoch's steps"),
    ("epoch_alloc_bytes_est", "B", "memory", "bytes per step (traced pass) times the epoch's steps"),
    ("epoch_alloc_count_python_est", "count", "count", "Python-allocator allocations per step (traced pass) times the epoch's steps"),
    # identical_closures
    ("cold_time", "s", "time", "the first call of a step"),
    ("warm_time", "s", "time", "a later call of a step (after warm-up)"),
    ("cold_alloc_count", "count", "count", "allocations of a step's first call, less the tracker's floor (as "
     "alloc_count: raw = value + params.floor)"),
    ("cold_alloc_bytes", "B", "memory", "bytes allocated by a step's first call"),
    ("warm_alloc_count", "count", "count", "allocations of a later call of a step, less the tracker's floor (as "
     "alloc_count: raw = value + params.floor)"),
    ("warm_alloc_bytes", "B", "memory", "bytes allocated by a later call of a step"),
    ("cold_alloc_count_python", "count", "count", "Python-allocator allocations of a step's first call, less the "
     "tracker's floor (as alloc_count_python: raw = value + params.floor)"),
    ("warm_alloc_count_python", "count", "count", "Python-allocator allocations of a later call of a step, less the "
     "tracker's floor (as alloc_count_python: raw = value + params.floor)"),
    ("cold_compiles", "count", "count", "graphs torch.compile compiled in a step's first call"),
    ("warm_compiles", "count", "count", "graphs torch.compile compiled in later calls"),
    ("recompiles", "count", "count", "compiles for a code object that already held a compiled entry"),
    ("cache_entries", "count", "count", "compiled entries of the step's code object afterwards"),
):
    METRICS.register(_name, _unit, _kind, _meaning)
