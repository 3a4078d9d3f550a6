"""Below the floor: the dot chain's gradient under a snapshot budget, from 2 to depth.

Every budget N runs `benchlib.autodiff.grad(..., checkpoint=N)` (binomial, Revolve) in a fresh
process, beside `manual` (the floor that stores every z) and the "sqrt" policy: measured peak
memory and time, the tape's exact counters (`saved_bytes_peak`, `peak_total_bytes`,
`recomputed_nodes`) and Revolve's predicted recomputation count for the same chain, so the
schedule is checked against its theory. Each case's gradient is compared with manual's.
"""

from __future__ import annotations

from collections.abc import Iterable

from benchlib import autodiff
from benchlib.errors import Refused
from benchlib.autodiff import ops
from benchlib.autodiff.checkpoint import revolve_cost
from benchlib.engines import get_engine
from benchlib.benchmark import Benchmark, Config, Parameter
from benchlib.trials.cases import Cases, EngineComparison, compare_engines, comparison_parameters
from benchlib.engines.gradients import save_gradient
from benchlib.engine_names import BENCHLIB_CHECKPOINT, MANUAL
from benchlib.measure import Case
from benchlib.workloads import dot_chain

TARGET = "benchlib.workloads.checkpointing:case"
ENGINES = (MANUAL, BENCHLIB_CHECKPOINT)
SQRT = "sqrt"


def case(*, device, engine: str, D: int, depth: int, dtype: str, gradient_dir: str, budget, seed: int = 0) -> Case:
    """`manual`, or benchlib's engine under `budget` snapshots ("sqrt" or an int), set up in the child;
    the check reports the tape's counters and Revolve's prediction."""
    chosen = get_engine(engine)
    x_np, z_np, _ = dot_chain.make_data(D, dtype, seed)
    x, z = chosen.asarray(x_np, device), chosen.asarray(z_np, device)
    del x_np, z_np
    if chosen.hand_written:  # each under its own name: `manual` the lean floor, `manual-seed` the seed's code
        xp = chosen.namespace(device)
        gradient = chosen.gradient(dot_chain.chain_loss(xp, depth), 0, manual=dot_chain.hand_written_gradients(xp, depth))
    else:
        gradient = autodiff.grad(dot_chain.chain_loss(ops, depth), 0, checkpoint=budget)

    def check(result) -> dict[str, float]:
        save_gradient(result, gradient_dir, engine)
        if chosen.hand_written:
            return {}
        stats = gradient.stats
        counters = {"recomputed_nodes": stats.recomputed_nodes, "saved_bytes_peak": stats.saved_bytes_peak,
                    "peak_total_bytes": stats.peak_total_bytes}
        if budget != SQRT:
            counters["revolve_recomputations"] = revolve_cost(depth, budget)  # the chain has depth steps
        return counters

    return Case(lambda: gradient(x, z), check)


def check_budgets(budgets: Iterable, depth: int) -> list[int]:
    """Budgets as a list of distinct ints in 1..depth; what is wrong is said otherwise."""
    if isinstance(budgets, (str, int)) or not list(budgets):
        raise Refused(f"budgets must be a non-empty list of snapshot counts in 1..depth ({depth}), got {budgets!r}")
    budgets = list(budgets)
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= depth]
    if bad:
        raise Refused(f"budgets must be integers in 1..depth ({depth}), got {bad}")
    if len(set(budgets)) != len(budgets):
        raise Refused(f"budgets lists a value twice: {budgets}")
    return budgets


def run(config: Config, device="auto", *, progress=print, results=None) -> EngineComparison:
    """manual and benchlib-checkpoint at every budget (and "sqrt"), each case in a fresh process;
    `config` is this benchmark's (`BENCHMARK.config(...)`)."""
    D, depth, dtype = config.D, config.depth, config.dtype
    cases = Cases(BENCHMARK.name, TARGET,
                  {f"budget={budget}": {"D": D, "depth": depth, "budget": budget, "seed": dot_chain.DATA_SEED}
                   for budget in [*config.budgets, SQRT]},
                  memory_required=lambda engine, _params: dot_chain.memory_required_bytes(engine, D, depth, dtype),
                  describe={"x_scaling": dot_chain.X_SCALING}, engines=ENGINES)
    return compare_engines(cases, config, device=device, progress=progress, results=results)


BENCHMARK = Benchmark(
    name="checkpointing",
    question="How far below the hand-written floor does the dot chain's gradient go under a snapshot budget "
             "(Revolve) or √n snapshots, at what cost in time and recomputation?",
    seed=dot_chain.SEED,
    notebook="checkpointing.ipynb",
    cases="the chain's gradient under each snapshot budget and under √n snapshots, beside manual, each in fresh "
          "processes: peak, time, the tape's counters and Revolve's predicted recomputations",
    parameters=(
        *dot_chain.chain_parameters(D=500, depth=100, quick_depth=12),
        Parameter("budgets", (2, 3, 5, 10, 20, 50, 100), "snapshot budgets (each in 1..depth; \"sqrt\" always runs too)",
                  quick=(2, 4, 12), minimum=1),
        # the engines are fixed (manual and benchlib-checkpoint): no parameter here
        *(p for p in comparison_parameters(dtype="float64", engines=ENGINES, repeats=1, trials=5, warmup=0)
          if p.name != "engines"),
    ),
    rules=lambda config: check_budgets(config.budgets, config.depth),
    memory=lambda config, device: dot_chain.memory_required_bytes(MANUAL, config.D, config.depth, config.dtype),
    headline=("peak_bytes", "time", "recomputed_nodes"),
    metrics=(  # the tape's exact counters and Revolve's prediction
        ("recomputed_nodes", "count", "count", "tape nodes recomputed in one checkpointed backward pass"),
        ("saved_bytes_peak", "B", "memory", "peak bytes of saved activations on the checkpointed tape"),
        ("peak_total_bytes", "B", "memory", "peak bytes held by the checkpointed tape, snapshots included"),
        ("revolve_recomputations", "count", "count", "recomputations Revolve predicts for the same chain and budget"),
    ),
)
