"""Workload A: train 200 small MLPs at once, and find where step-time spikes come from.

The Flux thread "How to minimise the garbage collection time?" trains 200 nets of ~5000
parameters, sampling a minibatch and updating every net each step, and sees a 0.15 s step every
fourth ~1 ms step. This module trains the same ensemble (784-6-10 MLPs, 4,780 parameters, Adam)
with four strategies, each crossed with three GC policies and an optional long-lived heap:

strategies
    ``naive``             one module and one for-loop Adam per net; gradients recreated each step
    ``buffers_reused``    gradients zeroed in place; fused Adam (foreach where fused is missing)
    ``step_in_backward``  per-parameter ``register_post_accumulate_grad_hook`` steps Adam and frees
                          each gradient as soon as it is accumulated (NaiveGAflux's AutoOptimiser)
    ``batched_vmap``      parameters stacked per layer (``torch.func.stack_module_state``), one
                          ``vmap(functional_call)`` forward for all nets, one fused Adam
    ``batched_hand``      the same stacking by hand: with a shared minibatch the first layer of all
                          nets is one matrix product, the second one batched matmul; fused Adam

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
from its config). The benchmark name, the minibatch order and the load average, shared with `lenet`, are
`benchlib.workloads.mnist_training`'s (outside this package, so `lenet` imports them without this __init__).
"""
from benchlib.workloads.mnist_training import BENCHMARK, load_average, minibatch_indices
from benchlib.workloads.ensembles.config import (
    STRATEGIES, GC_POLICIES, RAISED_THRESHOLDS, PER_NET_STRATEGIES, PARAM_NAMES, EnsembleConfig,
    initial_parameters,
)
from benchlib.workloads.ensembles.strategies import (
    Strategy, Naive, BuffersReused, StepInBackward, BatchedVmap, BatchedHand, evaluate, STRATEGY_CLASSES,
    make_strategy,
)
from benchlib.workloads.ensembles.cycles import StepCycles, check_step
from benchlib.workloads.ensembles.gc_policies import (
    GCPolicy, long_lived_heap, full_collection_pauses, collection_pause_records, pause_frame, pause_records,
)
from benchlib.workloads.ensembles.training import (
    TrainResult, train, run_grid, thread_sweep, cycle_sweep, summary_frame, steps_frame, pauses_frame,
)
from benchlib.workloads.ensembles.floor import (
    matmul_flops, calibration_flop_rate, flop_floor, flop_floor_records,
)
from benchlib.workloads.ensembles.study import Study, progress_line, run_study
