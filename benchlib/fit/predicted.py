"""`benchlib fit --device cuda` on a machine without a GPU: each engine's reserved peak predicted from the
step traced under fake tensors (no memory taken) as a named GPU would run it, and replayed through a model of the
CUDA caching allocator (`benchlib.measure.caching_allocator`). Nothing here is measured on a GPU, and everything
it shows says so (`BASIS`).

The trace follows what a measured CUDA process does (`benchlib.usermodel.measuring`): the model and the
batch built, then moved to the device (parameters and buffers in the order `Module.to` copies them, then
the batch), cuBLAS's workspaces taken (`prime_cuda_libraries`), and `STEPS` steps, whose first makes the
gradients and the optimizer's state. Every tensor storage the step makes is an allocation of its bytes, freed when
torch frees it; the allocator model turns that sequence into reserved segments. Only the first two steps are
traced where the second is steady: the later ones are its allocations again (`_replay`), which halves a trace. The step
runs under `cuda_policy.as_cuda(gpu)`: autocast casts as CUDA's does, and attention runs the kernel CUDA would
choose on that GPU (checked against an H200's measurements: tests/test_cuda_truth.py).

What the trace still cannot know: where CUDA picks a kernel with a workspace of its own (cuDNN's convolution
algorithms, cuDNN's recurrent layers), its bytes differ, and the answer for such a step is labelled a floor, not a
bound (`Prediction.unseen`); cuBLAS's workspace size depends on the GPU and `CUBLAS_WORKSPACE_CONFIG`
(`CUBLAS_WORKSPACES` assumes what an H100 and an H200 took).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchlib.fit.asking import scale_points
from benchlib.fit.cuda_policy import DEFAULT_GPU, GPUS, Gpu, TorchRules, as_cuda, gpu_named, torch_named
from benchlib.fit.search import SEARCH_LIMIT, Bracketing, largest_under
from benchlib.fit.sizing import MIN_POINTS, TRACE_REACH
from benchlib.fit.tracing import untraced_reason
from benchlib.usermodel.shapes import materialized
from benchlib.measure.caching_allocator import CachingAllocatorModel

BASIS = "predicted, not measured on a GPU"
# how far a traced reserved peak may lie from what the GPU reserves at the same step: tests/test_cuda_truth.py fails
# any GPU-measured truth row predicted farther off, so a prediction's interval is this either side of its trace
TRACE_TOLERANCE = 0.05
CUBLAS_WORKSPACES = (32 << 20, 32 << 20)  # cuBLAS's, for the caller's thread and autograd's (Hopper, torch 2.11)
STEPS = 4  # fit's measured processes run one warm-up step and three measured ones
STEPS_TRACED = 2  # the first makes the optimizer's state, the second is the steady step the others repeat (`_replay`)
EXTRAPOLATION = TRACE_REACH[-1]  # how far past the largest value that fit a search's next trace may lie, at most
OPERATORS_GROWTH = 1.05  # a trace's operators growing past this over the grid: a loop over the value
# Operators whose CUDA kernels take memory a trace of the CPU's operators does not see, by what an aten name holds:
# the trace's answer for a step that runs them is a floor of what CUDA takes (checked on an H100 in
# docs/techniques.md: a small BatchNorm CNN's largest batch predicted 39% too large, a transformer's 4%).
ATTENTION = "attention ran the CPU's own kernel, not the one CUDA would choose (called past the dispatcher)"
GPU_KERNEL_CHOICES = {
    "convolution": "cuDNN picks each convolution's algorithm, and its workspace, on the GPU",
    "_scaled_dot_product_flash_attention_for_cpu": ATTENTION,  # as_cuda routes scaled_dot_product_attention
}
# ...and by module, where the CPU decomposes what CUDA runs as one kernel (a GRU's cells, say)
RECURRENT = "cuDNN runs nn.LSTM, nn.GRU and nn.RNN as one kernel with a reserve buffer of its own"


@dataclass(frozen=True)
class Prediction:
    """The allocator model's counters after the traced steps: `reserved` is the reserved peak (segments
    never go back in the default configuration), `allocated` the peak of bytes in blocks."""

    reserved: int
    allocated: int
    segments: int
    operators: int  # operators the traced steps dispatched: what a trace costs, whatever the tensors' sizes
    unseen: frozenset[str] = frozenset()  # why CUDA's kernels take memory the trace did not see (GPU_KERNEL_CHOICES)
    attention: frozenset[str] = frozenset()  # the attention kernels CUDA would run, as the trace ran them
    assumed: frozenset[str] = frozenset()  # where a choice could not be known and the larger branch was taken


class _StorageEvents:
    """Every tensor storage an operator returns, allocated in the allocator model at its first sight and freed
    when torch frees it (a weak reference's callback: torch keeps a storage's Python object while it lives), and
    logged in order (`log`: (key, bytes) for an allocation, (key, None) for a free) for `_replay`."""

    def __init__(self, allocator: CachingAllocatorModel):
        from torch.utils.weak import WeakIdKeyDictionary

        self.allocator = allocator
        self.keys = itertools.count()
        self.seen = WeakIdKeyDictionary()  # storages compare by identity
        self.operators = 0
        self.unseen: set[str] = set()
        self.log: list[tuple[object, int | None]] = []

    def malloc(self, key: object, nbytes: int) -> None:
        self.log.append((key, nbytes))
        self.allocator.malloc(key, nbytes)

    def free(self, key: object) -> None:
        self.log.append((key, None))
        self.allocator.free(key)

    def note(self, tensor) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        if not isinstance(tensor, torch.Tensor):
            return
        if isinstance(tensor, DTensor):  # a sharded parameter, gradient or state: the rank holds its local shard
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage in self.seen:
            return
        key = next(self.keys)
        self.seen[storage] = key
        self.malloc(key, storage.nbytes())
        weakref.finalize(storage, self.free, key)

    def resized(self, tensor) -> None:
        """A storage resized in place (FSDP frees a block's gathered parameters so, and gathers them again:
        `parallel.storage_resizes`): its block freed, and one of its new size taken."""
        storage = tensor.untyped_storage()
        key = self.seen.get(storage)
        if key is None:
            self.note(tensor)
            return
        self.free(key)
        self.malloc(key, storage.nbytes())


def _recording_mode(events: _StorageEvents):
    """A dispatch mode that notes the storages of every operator's outputs."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            events.operators += 1
            name = func.overloadpacket.__name__
            events.unseen.update(why for part, why in GPU_KERNEL_CHOICES.items() if part in name)
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                events.note(leaf)
            return out

    return Recording()


def _moved_order(module) -> list:
    """Parameters and buffers in the order `Module.to` copies them: each child's first, then the module's own."""
    tensors = []
    for child in module.children():
        tensors.extend(_moved_order(child))
    tensors.extend(p for p in module._parameters.values() if p is not None)
    tensors.extend(b for b in module._buffers.values() if b is not None)
    return tensors


def predict_reserved(model_file, engine: str, values: Mapping[str, Any],
                     workspaces: Sequence[int] = CUBLAS_WORKSPACES, fake: bool = True,
                     world_size: int = 1, gpu: Gpu | None = GPUS[DEFAULT_GPU], rules: TorchRules | None = None
                     ) -> Prediction:
    """The predicted CUDA reserved peak of `engine`'s step at `values` on `gpu`, its kernels chosen as the torch
    release `rules` describes (default: the installed one; see the module's docstring). Raises
    where torch cannot trace the step under fake tensors (data-dependent control flow, torch.func's wrappers). On
    `world_size` ranks, rank 0's, simulated in this process (`simulated_rank`): its parallel strategy places the
    model and the file's batch is rank 0's. `fake=False` records the same step over real tensors, as a test
    compares, with the CPU's kernels (the only ones real CPU tensors have)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from benchlib.engines.techniques.parallel import simulated_rank, storage_resizes
    from benchlib.usermodel.case import combination_of, make_step

    combination = combination_of(model_file, engine)
    if combination.untraceable is not None:
        raise ValueError(combination.untraceable)
    allocator = CachingAllocatorModel()
    events = _StorageEvents(allocator)
    ranks = simulated_rank(world_size) if world_size > 1 else contextlib.nullcontext()
    # the model is made on the meta device and materialized under the mode: those tensors are not fake yet
    tensors = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    kernels = as_cuda(gpu, rules) if gpu is not None and fake else contextlib.nullcontext(None)
    with warnings.catch_warnings(), ranks, tensors, kernels as policy:
        warnings.simplefilter("ignore")
        build = lambda: model_file.seeded_model(values)  # noqa: E731 - the placement's builder
        # on the CPU, where the trace runs: moving fake parameters is refused, and the bytes are the same
        model = combination.place(build, torch.device("cpu")) if world_size > 1 else materialized(build)
        batch = model_file.seeded_batch(values)
        if any(isinstance(module, torch.nn.RNNBase) for module in model.modules()):
            events.unseen.add(RECURRENT)
        real = [index for index, tensor in enumerate(batch) if not isinstance(tensor, FakeTensor)]
        if real and fake:  # real data would take real memory at the large values a search asks
            raise ValueError(f"batch() item(s) {real} are real tensors under fake tensor mode")
        for tensor in (*_moved_order(model), *batch):
            events.note(tensor)
        for index, nbytes in enumerate(workspaces):
            allocator.malloc(("cublas workspace", index), nbytes)
        with _recording_mode(events), storage_resizes(events.resized):
            step = make_step(model_file, engine, values, model, batch)
            starts = []
            for _ in range(STEPS_TRACED):
                starts.append(len(events.log))
                step()
            # the steps after the steady one are its events again, unless the two traced steps say otherwise
            if not _replay(allocator, events.log, starts, STEPS - STEPS_TRACED):
                for _ in range(STEPS - STEPS_TRACED):
                    step()
        del step, model, batch
    chosen = (frozenset(policy.attention), frozenset(policy.assumed)) if policy is not None else ((), ())
    return Prediction(allocator.peak_reserved, allocator.peak_allocated, allocator.segments, events.operators,
                      frozenset(events.unseen), *map(frozenset, chosen))


def _replay(allocator: CachingAllocatorModel, log: list[tuple[object, int | None]], starts: list[int],
            steps: int) -> bool:
    """Replay the last traced step's allocations and frees `steps` more times, as the steps after it would make
    them, and say True; or False, replaying nothing, where the two traced steps do not hand over alike (then the
    caller traces the rest). A steady step's storages are new each time, except the ones it keeps for the next
    (the gradients): the storages the first step kept and the second freed must match, in order and bytes, the
    ones the second step kept, and each replayed step frees the previous one's where the second freed the
    first's. Storages made before the steps (parameters, the batch) are the same storages in every step."""
    before, first, second = log[:starts[-2]], log[starts[-2]:starts[-1]], log[starts[-1]:]
    old = {key for key, _ in before}
    live, size = {}, {}

    def walk(events: list) -> None:
        for key, nbytes in events:
            live[key] = nbytes is not None
            size[key] = nbytes if nbytes is not None else size.get(key)

    walk(first)
    kept_by_first = {key for key, alive in live.items() if alive}
    walk(second)
    born_first = list(dict.fromkeys(key for key, nbytes in first if nbytes is not None and key not in old))
    born_second = list(dict.fromkeys(key for key, nbytes in second if nbytes is not None and key not in old
                                     and key not in born_first))
    handed = [key for key in born_first if key in kept_by_first and not live[key]]
    kept = [key for key in born_second if live[key]]
    if [size[key] for key in handed] != [size[key] for key in kept]:
        return False
    previous = dict(zip(kept, kept))
    for step in range(steps):
        names = {key: (key, step) for key in born_second}
        names.update((handed_key, previous[kept_key]) for handed_key, kept_key in zip(handed, kept))
        for key, nbytes in second:
            if nbytes is None:
                allocator.free(names.get(key, key))
            else:
                allocator.malloc(names.get(key, key), nbytes)
        previous = {key: names[key] for key in kept}
    return True


def largest_fitting(reserved: Callable[[int], int], traced: dict[int, int], limit: int,
                    reach: int | None = None) -> int | None:
    """The largest value whose traced reserved peak stays under `limit` (`traced`: value -> reserved, extended as
    it asks). None when not even the smallest fits; `SEARCH_LIMIT` when the total never reaches the limit. With
    `reach`, nothing beyond it is traced: `reach` itself when it fits there (the caller extrapolates).

    A trace costs seconds and its peak is nearly linear in the value, so each next value is where the line through
    the nearest traces meets the limit (past the largest fitting one: at most `EXTRAPOLATION` times it), then its
    neighbour, which ends the search where the line was right; guesses that do not halve the interval are followed
    by a bisection, so a curve far from a line costs at most three traces per halving."""
    return largest_under(reserved, limit, traced, Bracketing(reach=EXTRAPOLATION, ceiling=reach or SEARCH_LIMIT,
                                                            neighbour=True))


def predict_engine(model_file, engine: str, values: Mapping[str, Any], scale: str, limit: float,
                   world_size: int = 1, gpu: str = DEFAULT_GPU, torch_version: str | None = None) -> dict:
    """One engine's prediction on the GPU `gpu` names under the torch release `torch_version` (None: the installed
    one's), in a fork of the child that read the file (`in_child.predicted_engines`): its reserved peaks (rank 0's of `world_size`) traced at the grid's ends, then where the search for the largest
    value under `limit` asks (`largest_fitting`); as JSON: `traced` (value -> reserved), `largest`, `reach` (how far
    the search traced, None: unbounded), `unseen`, `attention` (the kernels CUDA would run), `assumed` (the larger
    branches taken); or `reason` where its step could not be traced."""
    points = scale_points(values[scale], scale)
    card, rules = gpu_named(gpu), torch_named(torch_version)
    made: dict[int, Prediction] = {}

    def trace(value: int) -> int:
        made[value] = predict_reserved(model_file, engine, {**values, scale: value}, world_size=world_size, gpu=card,
                                       rules=rules)
        return made[value].reserved

    try:
        # the grid's ends, then where the search asks (it traces the answer and the value past it): the other
        # points only where fewer than the size model needs were traced
        traced = {value: trace(value) for value in (points[0], points[-1])}
        # a step whose operators grow with the value (a loop over a sequence) costs a trace that grows too: traced
        # no farther than `TRACE_REACH` times the value, and extrapolated by the size model beyond. A few operators
        # fewer at a value of 1 (a dimension torch squeezes: GPT-2's checkpointed blocks, 20 of 31164) are no loop
        operators = [prediction.operators for prediction in made.values()]
        reach = values[scale] * TRACE_REACH[-1] if max(operators) > OPERATORS_GROWTH * min(operators) else None
        largest = largest_fitting(trace, traced, limit, reach)
        for value in points[1:-1]:
            if len(traced) < MIN_POINTS and value not in traced:
                traced[value] = trace(value)
    except Exception as error:  # noqa: BLE001 - torch's tracer or the file's code under fake tensors: said, not fatal
        return {"reason": f"not predicted: its step could not be traced under fake tensors ({untraced_reason(error)})"}

    def union(part: str) -> list[str]:
        return sorted(set().union(*(getattr(prediction, part) for prediction in made.values())))

    return {"traced": {str(value): reserved for value, reserved in sorted(traced.items())}, "largest": largest,
            "reach": reach, "unseen": union("unseen"), "attention": union("attention"), "assumed": union("assumed")}
