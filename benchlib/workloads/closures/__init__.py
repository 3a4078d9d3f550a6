"""identical_closures (Zygote.jl #1206): do structurally identical loss closures cost the same?

In Julia every closure has its own type and the gradient code is compiled per type; in the seed
the first-created of two identical closures kept 419 allocations per call where the second
needed 329. Python has no per-type compilation, but it has per-code-object state: each `setup`
function below owns the code object of the closure it builds, and torch.compile caches compiled
graphs per code object (CPython's specialising interpreter also warms up per code object).

Two minimal working examples (MWEs), written once against an engine's array namespace `xp`:
- `dense`: the seed's MWE. Dense(8 -> 1), mse loss, X 8x10, Y 1x10 in float32, batches of 2;
  `setup1` and `setup2` build the same loss closure over the model; `train(state)` takes one
  gradient per batch and collects them.
- `reduced`: the seed's reduction. x -> sum(exp(x)) splatted over a 1-tuple, one pullback.

The protocol (`run_protocol`) follows the seed: initial (state1), re-run, structurally identical
new (state2), re-setup initial (state1 built again); the `reversed` order starts from setup2.
Each step's first call is its cold measurement, followed by warm-up calls; the warm (steady-state)
calls of the four steps are then timed round-robin. Times and allocations come from separate
passes (tracing slows code), each starting from fresh set-ups and, for torch.compile, from
`torch._dynamo.reset()`. `run` gathers every MWE x engine x order; `seed_table` and
`verdict_table` turn the records into the notebook's tables (verdicts: `benchlib.results.stats`).

Modules: `spec` (names and settings), `engines`, `mwes`, `protocol` (passes and records), `tables`.
"""

from benchlib.workloads.closures.spec import (
    BENCHMARK, MWES, MWE_DTYPES, ORDERS, INITIAL, RERUN, NEW, RESETUP, STEPS, PHASES, PAIRS, SHARED_ENGINES,
    COMPILE_ENGINE, FUNC_ENGINE, ENGINES, VALID_ENGINES, COMPILE_BACKENDS, N_SAMPLES, N_IN, N_OUT, BATCH_SIZE,
    GRADS_IDENTICAL, NOT_APPLICABLE, TRACKER_CASE, DEFAULTS,
)
from benchlib.workloads.closures.engines import (
    CompileCounter, ClosureEngine, not_applicable, make_engine,
)
from benchlib.workloads.closures.mwes import (
    ClosureState, Dense, mse, dense_arrays, reduced_arrays, setup1, setup2, train, splat, reduced_setup1,
    reduced_setup2, reduced_train, reference_gradients, MWE, gradients_numpy, identical,
)
from benchlib.workloads.closures.protocol import (
    protocol_states, case_name, validate, run_protocol, tracker_records, run,
)
from benchlib.workloads.closures.tables import (
    expand_cases, seed_table, verdict_table, differing_pairs, tracker_table,
)
