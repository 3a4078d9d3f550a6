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
`verdict_table` turn the records into the notebook's tables (verdicts: `benchlib.analysis.stats`).

Modules: `spec` (names and settings), `engines`, `mwes`, `protocol` (passes and records), `tables`.
"""

from benchlib.errors import Refused
from benchlib.workloads.closures.spec import (
    NAME, MWES, MWE_DTYPES, ORDERS, INITIAL, RERUN, NEW, RESETUP, STEPS, PHASES, PAIRS, SHARED_ENGINES,
    COMPILE_ENGINE, FUNC_ENGINE, ENGINES, VALID_ENGINES, COMPILE_BACKENDS, N_SAMPLES, N_IN, N_OUT, BATCH_SIZE,
    GRADS_IDENTICAL, NOT_APPLICABLE, TRACKER_CASE, Protocol,
)
from benchlib.workloads.closures.engines import (
    CompileCounter, ClosureEngine, not_applicable, make_engine,
)
from benchlib.workloads.closures.mwes import (
    ClosureState, Dense, mse, dense_arrays, reduced_arrays, setup1, setup2, train, splat, reduced_setup1,
    reduced_setup2, reduced_train, reference_gradients, MWE, gradients_numpy, identical,
)
from benchlib.workloads.closures.protocol import (
    protocol_states, case_name, run_protocol, tracker_records, run,
)
from benchlib.workloads.closures.tables import (
    expand_cases, seed_table, verdict_table, differing_pairs, tracker_table,
)

from benchlib.benchmark import Benchmark, Parameter, Seed, distinct
from benchlib.analysis.seed_verdicts import RatioRule


def _rules(config) -> None:
    for name in ("mwes", "engines", "orders"):
        distinct(name, config[name])
    if not 0 < config.alpha < 1:
        raise Refused(f"alpha must be between 0 and 1, got {config.alpha!r}")


_ZYGOTE = "Zygote #1206: a structurally identical new closure costs the same"
BENCHMARK = Benchmark(
    name=NAME,
    question="Do structurally identical loss closures cost different allocations or time per gradient call?",
    seed=Seed("FluxML/Zygote.jl #1206, \"Difference in allocations of gradient() over structurally identical "
              "functions\"", "https://github.com/FluxML/Zygote.jl/issues/1206"),
    notebook="identical_closures.ipynb",
    cases="per MWE, engine and order, the seed's four steps (initial, re-run, structurally identical new, "
          "re-setup initial): cold and warm times, both allocation counts and compiles per call",
    parameters=(
        Parameter("mwes", MWES, "minimal working examples: dense (the seed's Dense MWE), reduced (its reduction)",
                  quick=("reduced",), choices=MWES),
        Parameter("engines", ENGINES, "gradient engines to run the protocol under", choices=VALID_ENGINES),
        Parameter("orders", tuple(ORDERS), "which setup builds the initial closure: seed (setup1) or reversed",
                  quick=("seed",), choices=tuple(ORDERS)),
        Parameter("warmup", Protocol.warmup, "warm-up calls after each step's cold call", quick=1, minimum=0),
        Parameter("repeats", Protocol.repeats, "timed warm calls per step", quick=5, minimum=1),
        Parameter("cold_passes", Protocol.cold_passes, "timing passes from fresh set-ups (cold samples)", quick=1,
                  minimum=1),
        Parameter("alloc_passes", Protocol.alloc_passes, "allocation-tracing passes from fresh set-ups", quick=1,
                  minimum=1),
        Parameter("alloc_samples", Protocol.alloc_samples, "traced warm calls per step and pass", quick=1,
                  minimum=1),
        Parameter("backend", Protocol.backend, "torch.compile backend", quick="eager", choices=COMPILE_BACKENDS),
        Parameter("alpha", 0.01, "significance level of the rank tests (exclusive of 0 and 1)", minimum=0, maximum=1),
        Parameter("min_effect", 0.05, "smallest relative difference in time a verdict calls a difference", minimum=0),
        Parameter("attribute", False, "one more pass after the measured ones: each step's warm call by allocation "
                                      "site, and the site-by-site diff of each verdict pair (`benchlib run --attribute`)"),
    ),
    rules=_rules,
    headline=("warm_alloc_count", "warm_alloc_count_python", "warm_time", "cold_time"),
    verdicts=tuple(
        RatioRule(NAME, f"{_ZYGOTE} ({what}, {engine})", metric, engine, engine, low, high,
                  case=(("step", NEW),), baseline_case=(("step", INITIAL),), per=("mwe", "order"))
        for engine in ENGINES
        for metric, what, low, high in (("warm_alloc_count", "warm allocations", 0.99, 1.01),
                                        ("warm_alloc_count_python", "warm Python allocations", 0.99, 1.01),
                                        ("warm_time", "warm time", 0.9, 1.1),
                                        ("cold_time", "first-call time", 0.8, 1.25))),
    metrics=(
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
        ("grads_identical", "", "check", "1 when two gradients are bit-identical, else 0"),
    ),
    dimensions={"tracker": "the allocation tracker measured on itself"},
)
