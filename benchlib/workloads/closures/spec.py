"""identical_closures' names and settings: MWEs, orders, protocol steps, verdict pairs, engines."""

from __future__ import annotations

from dataclasses import dataclass

from benchlib.engine_names import AUTOGRAD, BENCHLIB_DEFERRED, BENCHLIB_INPLACE, TORCH, TORCH_COMPILE, TORCH_FUNC

NAME = "identical_closures"
MWES = ("dense", "reduced")
MWE_DTYPES = {"dense": "float32", "reduced": "float64"}  # each MWE runs in the seed's dtype
# Which setup builds state1 and which state2, per order.
ORDERS = {"seed": ("setup1", "setup2"), "reversed": ("setup2", "setup1")}
INITIAL, RERUN, NEW, RESETUP = "initial", "re-run", "structurally identical new", "re-setup initial"
STEPS = (INITIAL, RERUN, NEW, RESETUP)
PHASES = ("cold", "warm")
# The pairs a verdict is given for. A re-run's first call is not cold, so cold has no control pair.
PAIRS = {
    "warm": ((INITIAL, NEW), (RESETUP, NEW), (INITIAL, RERUN)),
    "cold": ((INITIAL, NEW), (RESETUP, NEW)),
}
SHARED_ENGINES = (BENCHLIB_INPLACE, BENCHLIB_DEFERRED, AUTOGRAD, TORCH)
COMPILE_ENGINE, FUNC_ENGINE = TORCH_COMPILE, TORCH_FUNC  # this workload's own engines, torch's adapters
ENGINES = (BENCHLIB_INPLACE, AUTOGRAD, TORCH, COMPILE_ENGINE, FUNC_ENGINE)
VALID_ENGINES = SHARED_ENGINES + (COMPILE_ENGINE, FUNC_ENGINE)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
N_SAMPLES, N_IN, N_OUT, BATCH_SIZE = 10, 8, 1, 2
GRADS_IDENTICAL = "grads_identical"
NOT_APPLICABLE = "not_applicable"
TRACKER_CASE = "no-op"  # the tracker's own rows: dimension "tracker", variant the tracker's name

@dataclass(frozen=True)
class Protocol:
    """How the seed's protocol is sized: calls per step, passes from fresh set-ups, the compile backend
    and the data seed. Its defaults are the benchmark's (the declaration reads them from here)."""

    warmup: int = 3
    repeats: int = 30
    cold_passes: int = 5
    alloc_passes: int = 2
    alloc_samples: int = 2
    backend: str = "inductor"
    seed: int = 0


