"""Every engine's name, written once: records on disk carry these strings, so they never change.

This module imports nothing but `benchlib.errors` and sits below every layer, so any of them may import it, `benchlib.records`
(the lowest) included, without importing `benchlib.engines`. The registry, `benchlib.engines.ENGINES`,
builds its engines under these names.
"""

from benchlib.errors import Refused

MANUAL = "manual"  # the lean hand-written gradient each workload supplies: the floor every engine is checked against
MANUAL_SEED = "manual-seed"  # the seed's own hand-written code, with its buffer lifetimes, where a workload has one
BENCHLIB_INPLACE = "benchlib-inplace"  # benchlib.autodiff, gradients accumulated in place
BENCHLIB_DEFERRED = "benchlib-deferred"  # benchlib.autodiff, every contribution kept until the end (autograd before #219)
BENCHLIB_CHECKPOINT = "benchlib-checkpoint"  # benchlib.autodiff in place with about √n forward snapshots
AUTOGRAD = "autograd"  # HIPS autograd on NumPy
TORCH = "torch"  # torch.autograd
TORCH_CHECKPOINT = "torch-checkpoint"  # torch.autograd under torch.utils.checkpoint
# torch.compile of the loss (in the registry for the built-in chains, and identical_closures' own engine)
TORCH_COMPILE = "torch.compile"
# Not in the registry: identical_closures' and model files' torch.func.grad
TORCH_FUNC = "torch.func"
# Not in the registry: a user model file's engine, the optimizer step fused into backward (NaiveGAflux's idea)
FUSED_OPTIMIZER = "fused-optimizer"
# The memory techniques (docs/techniques.md): sac and autocast in the registry too, the rest a model file's only
TORCH_SAC = "torch-sac"  # selective activation checkpointing: matmul outputs saved, the rest recomputed
TORCH_AUTOCAST = "torch-autocast"  # the forward pass under autocast to bfloat16
TORCH_MICROBATCH = "torch-microbatch"  # the batch in micro-batches, gradients accumulated
TORCH_OFFLOAD = "torch-offload"  # saved activations on the host (save_on_cpu), CUDA only
# Parallel strategies: a step on several torch.distributed ranks (benchlib run --ranks N --parallel ddp,fsdp)
DDP = "ddp"  # DistributedDataParallel: the whole model on every rank, gradients all-reduced
FSDP = "fsdp"  # FSDP2's fully_shard per repeated block and at the root
PARALLEL_STRATEGIES = (DDP, FSDP)
# torch.compile with the partitioner's activation memory budget below its default 1.0 (all it would save): one engine
# per budget, so each is a point of its own on the frontier
COMPILE_BUDGETS = (0.5, 0.1, 0.0)
TORCH_COMPILE_BUDGETS = {f"torch.compile-budget-{budget:g}": budget for budget in COMPILE_BUDGETS}

# Techniques join into one step with "+" (benchlib.engines.techniques): a combination's records carry the joined name,
# its parts in the techniques' registry order. The ones a model file's run adds by default, where they apply:
COMBINED = "+"


def split_names(text: str) -> list[str]:
    """Engine names given as one comma-separated string, where a name's bracket of modules keeps its own commas
    (`torch,torch-checkpoint[blocks.0-2,blocks.7]`)."""
    names, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            names.append(text[start:index].strip())
            start = index + 1
    return [*names, text[start:].strip()]
DEFAULT_COMBINATIONS = tuple(COMBINED.join(parts) for parts in (
    (TORCH_CHECKPOINT, TORCH_AUTOCAST), (TORCH_SAC, TORCH_AUTOCAST), (TORCH_AUTOCAST, TORCH_MICROBATCH),
    (TORCH_CHECKPOINT, TORCH_MICROBATCH), (FUSED_OPTIMIZER, TORCH_AUTOCAST),
    (TORCH_CHECKPOINT, TORCH_AUTOCAST, TORCH_MICROBATCH)))

def parallel_strategies_named(text: str) -> list[str]:
    """The strategies `-p parallel` names (comma-separated, each once, in order), or Refused saying which are valid."""
    named = [part.strip() for part in str(text).split(",") if part.strip()]
    unknown = [name for name in named if name not in PARALLEL_STRATEGIES]
    if unknown:
        raise Refused(f"parallel: {', '.join(map(repr, unknown))} is no parallel strategy; valid: "
                      f"{', '.join(PARALLEL_STRATEGIES)}, or both joined by a comma")
    return list(dict.fromkeys(named))


def no_spread(ranks: int) -> str:
    """Why several ranks with no parallel strategy and no engine that places the step are refused."""
    return (f"ranks={ranks}: say how the step is spread over them: --parallel {' or '.join(PARALLEL_STRATEGIES)} "
            f"(-p parallel=fsdp), or an engine that names one (-p engines=fsdp+torch-checkpoint)")


def no_ranks(strategies: list[str]) -> str:
    """Why a parallel strategy on one process is refused."""
    return f"{', '.join(strategies)} runs on several ranks: give --ranks N (N >= 2)"


# the engine every other's gradient is checked against, and drawn first: a role, which eager torch holds
REFERENCE = TORCH

# the registry's engines that differentiate with torch.autograd (a compiled forward is one node of its graph)
TORCH_AUTOGRAD = (TORCH, TORCH_CHECKPOINT, TORCH_SAC, TORCH_AUTOCAST, TORCH_COMPILE)

__all__ = ["MANUAL", "MANUAL_SEED", "BENCHLIB_INPLACE", "BENCHLIB_DEFERRED", "BENCHLIB_CHECKPOINT", "AUTOGRAD",
           "TORCH", "TORCH_CHECKPOINT", "TORCH_COMPILE", "TORCH_FUNC", "FUSED_OPTIMIZER",
           "TORCH_SAC", "TORCH_AUTOCAST", "TORCH_MICROBATCH", "TORCH_OFFLOAD", "DDP", "FSDP", "PARALLEL_STRATEGIES", "COMPILE_BUDGETS", "TORCH_COMPILE_BUDGETS",
           "TORCH_AUTOGRAD", "COMBINED", "split_names", "parallel_strategies_named", "DEFAULT_COMBINATIONS", "REFERENCE"]
