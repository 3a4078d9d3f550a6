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
    ``default``  Python's automatic collector as configured
    ``freeze``   ``gc.freeze()`` after set-up: everything alive then is never traversed again
    ``manual``   automatic GC disabled in the loop, ``gc.collect(generation)`` every K steps (a full
                 collection by default, as ``gc.collect()`` in a training loop does), and
                 ``torch.cuda.empty_cache()`` with it on CUDA (NaiveGAflux's GpuGcIterator)

The long-lived heap (``heap_sizes``): the training set held as a list of ``(tensor, label)``
tuples, as many scripts hold a dataset. Young collections never walk it; full collections do,
unless ``gc.freeze()`` moved it to the permanent generation first.

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
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchlib.results import make_record

BENCHMARK = "mnist_ensembles"
STRATEGIES = ("naive", "buffers_reused", "step_in_backward", "batched_vmap", "batched_hand")
GC_POLICIES = ("default", "freeze", "manual")
# Strategies that step the nets one by one: 20-30x slower per step, so the notebook gives them
# fewer steps (`per_net_steps`).
PER_NET_STRATEGIES = ("naive", "buffers_reused", "step_in_backward")
PARAM_NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")  # nn.Sequential(Linear, ReLU, Linear)


@dataclass(frozen=True)
class EnsembleConfig:
    """The ensemble and its optimiser; identical across strategies so their results compare."""

    n_nets: int = 200
    inputs: int = 784
    hidden: int = 6
    classes: int = 10
    batch: int = 64
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        for name in ("n_nets", "inputs", "hidden", "classes", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")

    @property
    def params_per_net(self) -> int:
        return self.inputs * self.hidden + self.hidden + self.hidden * self.classes + self.classes

    @property
    def flops_per_model_sample(self) -> int:
        """Matmul FLOPs of one training sample through one net: the forward's two products, and
        the backward's weight gradients of both layers plus the hidden-activation gradient (the
        input needs none). Bias, ReLU, softmax and Adam are left out: a floor, not an estimate."""
        forward = 2 * (self.inputs * self.hidden + self.hidden * self.classes)
        backward = 2 * self.inputs * self.hidden + 2 * 2 * self.hidden * self.classes
        return forward + backward


def initial_parameters(config: EnsembleConfig) -> dict[str, torch.Tensor]:
    """Stacked float32 initial parameters (n_nets leading), drawn like ``nn.Linear``'s default
    (uniform in +-1/sqrt(fan_in)) from a generator seeded with ``config.seed``."""
    gen = torch.Generator().manual_seed(config.seed)
    n, i, h, c = config.n_nets, config.inputs, config.hidden, config.classes

    def uniform(shape, fan_in):
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound

    return {
        "0.weight": uniform((n, h, i), i),
        "0.bias": uniform((n, h), i),
        "2.weight": uniform((n, c, h), h),
        "2.bias": uniform((n, c), h),
    }


def minibatch_indices(n_samples: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """(steps, batch) sample indices: epochs of seeded permutations, shared by every strategy."""
    if n_samples < batch:
        raise ValueError(f"the dataset has {n_samples} samples, fewer than one batch of {batch}")
    rng = np.random.default_rng(seed)
    per_epoch = n_samples // batch
    epochs = -(-steps // per_epoch)
    rows = [rng.permutation(n_samples)[: per_epoch * batch].reshape(per_epoch, batch) for _ in range(epochs)]
    return torch.from_numpy(np.concatenate(rows)[:steps].astype(np.int64))


def _make_net(config: EnsembleConfig, device=None) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(config.inputs, config.hidden), nn.ReLU(), nn.Linear(config.hidden, config.classes)
    ).to(device)


def _adam_kind(device: torch.device) -> dict:
    """Fused Adam where this torch supports it on ``device``, else the foreach implementation."""
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        torch.optim.Adam([probe], fused=True)
        return {"fused": True}
    except (RuntimeError, ValueError):
        return {"foreach": True}


def _per_net_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(n_nets, batch, classes) logits -> each net's mean cross-entropy, shape (n_nets,)."""
    n, b, c = logits.shape
    return F.cross_entropy(logits.reshape(n * b, c), y.repeat(n), reduction="none").view(n, b).mean(1)


class Strategy:
    """One way to train the ensemble; ``step(x, y)`` trains every net on the shared minibatch
    and returns the per-net losses (detached)."""

    name = ""
    optimizer = ""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def stacked_parameters(self) -> dict[str, torch.Tensor]:
        """Every net's parameters, stacked per layer (detached copies on the CPU)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release hooks; the default has none."""


class _PerNetStrategy(Strategy):
    def __init__(self, init: dict[str, torch.Tensor], config: EnsembleConfig, device: torch.device):
        self.config = config
        self.nets = []
        for index in range(config.n_nets):
            net = _make_net(config, device)
            with torch.no_grad():
                for name, param in net.named_parameters():
                    param.copy_(init[name][index])
            self.nets.append(net)

    def stacked_parameters(self):
        per_net = [dict(net.named_parameters()) for net in self.nets]
        return {name: torch.stack([p[name].detach().cpu() for p in per_net]) for name in PARAM_NAMES}

    def gradients(self, x, y) -> dict[str, torch.Tensor]:
        """Stacked gradients of each net's mean loss on (x, y), without an optimiser step."""
        grads = {name: [] for name in PARAM_NAMES}
        for net in self.nets:
            loss = F.cross_entropy(net(x), y)
            names, params = zip(*net.named_parameters())
            for name, g in zip(names, torch.autograd.grad(loss, params)):
                grads[name].append(g.cpu())
        return {name: torch.stack(gs) for name, gs in grads.items()}


class Naive(_PerNetStrategy):
    """One module and one for-loop Adam per net; ``zero_grad(set_to_none=True)`` recreates every
    gradient each step: the textbook loop, run 200 times."""

    name = "naive"
    optimizer = "Adam(foreach=False) per net"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        self.opts = [torch.optim.Adam(net.parameters(), lr=config.lr, foreach=False) for net in self.nets]

    def step(self, x, y):
        losses = []
        for net, opt in zip(self.nets, self.opts):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)


class BuffersReused(_PerNetStrategy):
    """Per-net modules, but gradients zeroed in place (allocated once) and fused Adam; losses
    written into one preallocated tensor."""

    name = "buffers_reused"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        kind = _adam_kind(device)
        self.optimizer = f"Adam({next(iter(kind))}=True) per net"
        self.opts = [torch.optim.Adam(net.parameters(), lr=config.lr, **kind) for net in self.nets]
        self.losses = torch.zeros(config.n_nets, device=device)

    def step(self, x, y):
        for index, (net, opt) in enumerate(zip(self.nets, self.opts)):
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            self.losses[index] = loss.detach()
        return self.losses.clone()


class StepInBackward(_PerNetStrategy):
    """Each parameter has its own Adam, stepped by a post-accumulate-grad hook the moment its
    gradient is ready; the gradient is then dropped, so no step ever holds all gradients."""

    name = "step_in_backward"
    optimizer = "Adam(foreach=False) per parameter, in a post-accumulate-grad hook"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        self.handles = []
        for net in self.nets:
            for param in net.parameters():
                opt = torch.optim.Adam([param], lr=config.lr, foreach=False)
                self.handles.append(param.register_post_accumulate_grad_hook(self._stepper(opt)))

    @staticmethod
    def _stepper(opt):
        def hook(_param):
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hook

    def step(self, x, y):
        losses = []
        for net in self.nets:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    def close(self):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class _StackedStrategy(Strategy):
    def __init__(self, init, config, device):
        self.config = config
        kind = _adam_kind(device)
        self.optimizer = f"Adam({next(iter(kind))}=True) over stacked parameters"
        self.params = {name: init[name].to(device).clone().requires_grad_(True) for name in PARAM_NAMES}
        self.opt = torch.optim.Adam(self.params.values(), lr=config.lr, **kind)

    def logits(self, x) -> torch.Tensor:
        raise NotImplementedError

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=False)
        losses = _per_net_losses(self.logits(x), y)
        losses.sum().backward()  # each net's gradient is that of its own mean loss
        self.opt.step()
        return losses.detach()

    def stacked_parameters(self):
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    def gradients(self, x, y):
        loss = _per_net_losses(self.logits(x), y).sum()
        grads = torch.autograd.grad(loss, list(self.params.values()))
        return {name: g.cpu() for name, g in zip(self.params, grads)}


class BatchedVmap(_StackedStrategy):
    """``torch.func``: ``stack_module_state`` layout, ``vmap`` over ``functional_call`` of one
    stateless copy of the net (on the meta device)."""

    name = "batched_vmap"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        base = _make_net(config, "meta")

        def one_net(params, x):
            return torch.func.functional_call(base, params, (x,))

        self._forward = torch.func.vmap(one_net, in_dims=(0, None))

    def logits(self, x):
        return self._forward(self.params, x)


class BatchedHand(_StackedStrategy):
    """Hand-batched: the shared minibatch meets all first layers in one ``addmm`` against the
    (n_nets*hidden, inputs) weight block; the second layers are one ``baddbmm``."""

    name = "batched_hand"

    def logits(self, x):
        n, h = self.config.n_nets, self.config.hidden
        w1, b1, w2, b2 = (self.params[name] for name in PARAM_NAMES)
        hidden = torch.addmm(b1.reshape(n * h), x, w1.reshape(n * h, -1).t()).relu_()  # (B, n*h)
        hidden = hidden.view(x.shape[0], n, h).transpose(0, 1)  # (n, B, h)
        return torch.baddbmm(b2.unsqueeze(1), hidden, w2.transpose(1, 2))  # (n, B, classes)


def evaluate(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each net's mean cross-entropy on (x, y) from stacked parameters (`stacked_parameters()`)."""
    w1, b1, w2, b2 = (params[name] for name in PARAM_NAMES)
    with torch.no_grad():
        hidden = torch.einsum("bi,nhi->nbh", x, w1).add_(b1.unsqueeze(1)).relu_()
        return _per_net_losses(torch.baddbmm(b2.unsqueeze(1), hidden, w2.transpose(1, 2)), y)


STRATEGY_CLASSES = {cls.name: cls for cls in (Naive, BuffersReused, StepInBackward, BatchedVmap, BatchedHand)}


def make_strategy(name: str, init: dict[str, torch.Tensor], config: EnsembleConfig, device) -> Strategy:
    """A strategy by name, its nets set to ``init`` (stacked, from `initial_parameters`)."""
    if name not in STRATEGY_CLASSES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")
    return STRATEGY_CLASSES[name](init, config, getattr(device, "torch", device))


class GCPolicy:
    """What the loop does about Python's collector. All policies start from a full collection,
    so each run begins with the same heap state."""

    def __init__(self, name: str, *, every: int = 10, generation: int = 2, cuda: bool = False):
        if name not in GC_POLICIES:
            raise ValueError(f"unknown GC policy {name!r}; valid: {', '.join(GC_POLICIES)}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"manual GC interval must be a positive integer, got {every!r}")
        if generation not in (0, 1, 2):
            raise ValueError(f"manual GC generation must be 0, 1 or 2, got {generation!r}")
        self.name, self.every, self.generation, self.cuda = name, every, generation, cuda
        self._was_enabled = True

    def describe(self) -> dict:
        labels = {"gc_policy": self.name}
        if self.name == "manual":
            labels |= {"gc_every": self.every, "gc_generation": self.generation}
        return labels

    def __enter__(self):
        self._was_enabled = gc.isenabled()
        gc.collect()
        if self.name == "freeze":
            gc.freeze()
        elif self.name == "manual":
            gc.disable()
        return self

    def after_step(self, step: int) -> None:
        """Inside the timed step: the manual policy's explicit collection every K steps."""
        if self.name == "manual" and (step + 1) % self.every == 0:
            gc.collect(self.generation)
            if self.cuda:
                torch.cuda.empty_cache()

    def __exit__(self, *exc):
        if self.name == "freeze":
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        return False


@dataclass
class TrainResult:
    """Per-step arrays and run-level figures of one strategy x GC policy x heap cell."""

    strategy: str
    labels: dict  # everything that identifies the cell (config, policy, heap, data, device...)
    step_s: np.ndarray
    gc_count: np.ndarray
    gc_s: np.ndarray
    gc_generations: list  # per step: generations of the collections that began in it
    loss: np.ndarray
    warmup: int
    alloc_count_per_step: float = math.nan
    alloc_bytes_per_step: float = math.nan
    alloc_source: str = ""
    peak_bytes: float = math.nan

    @property
    def timed(self) -> slice:
        return slice(self.warmup, None)

    def summary(self) -> dict[str, float]:
        """Step-time statistics over the timed steps; throughput counts every timed second."""
        times = self.step_s[self.timed]
        total = float(times.sum())
        samples = self.labels["n_nets"] * self.labels["batch"] * len(times)
        return {
            "step_time_median": float(np.median(times)),
            "step_time_p99": float(np.percentile(times, 99)),
            "step_time_max": float(times.max()),
            "throughput": samples / total,
            "gc_share": float(self.gc_s[self.timed].sum()) / total,
            "gc_pauses": float(self.gc_count[self.timed].sum()),
            "step_gc_time_max": float(self.gc_s[self.timed].max()),
            "alloc_count_per_step": self.alloc_count_per_step,
            "alloc_bytes_per_step": self.alloc_bytes_per_step,
            "peak_bytes": self.peak_bytes,
            "final_loss": float(self.loss[-1]),
        }

    def case(self) -> str:
        case = (f"{self.strategy}|gc={self.labels['gc_policy']}|heap={self.labels['heap_objects']}"
                f"|threads={self.labels['torch_threads']}")
        return f"{case}|sweep={self.labels['sweep']}" if self.labels.get("sweep") else case

    def records(self, device, per_step: bool = True) -> list[dict]:
        """Tidy rows: the summary metrics, and (if ``per_step``) one row per step and metric."""
        units = {
            "step_time_median": "s", "step_time_p99": "s", "step_time_max": "s",
            "throughput": "model-samples/s", "gc_share": "", "gc_pauses": "count", "step_gc_time_max": "s",
            "alloc_count_per_step": "count", "alloc_bytes_per_step": "B", "peak_bytes": "B", "final_loss": "",
        }
        common = dict(benchmark=BENCHMARK, case=self.case(), strategy=self.strategy, device=device,
                      dtype="float32", params=self.labels)
        rows = [make_record(metric=m, value=v, unit=units[m], **common) for m, v in self.summary().items()]
        if per_step:
            for metric, unit, values in (("step_time", "s", self.step_s), ("step_gc_pauses", "count", self.gc_count),
                                         ("step_gc_time", "s", self.gc_s), ("step_loss", "", self.loss)):
                rows += [make_record(metric=metric, value=float(v), unit=unit, repeat=i, **common)
                         for i, v in enumerate(values)]
        return rows


def train(
    strategy: Strategy,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
    batches: torch.Tensor,
    *,
    device,
    policy: GCPolicy,
    warmup: int = 5,
    alloc_steps: int = 3,
    labels: dict | None = None,
) -> TrainResult:
    """Run ``len(batches) - alloc_steps`` timed steps under ``policy``, then the allocation pass.

    ``device`` is a `benchlib.measure.Device`. The last ``alloc_steps`` rows of ``batches`` feed the
    allocation pass, so the timed steps see the same minibatches whatever ``alloc_steps`` is.
    """
    from benchlib.measure import count_allocations, measure_steps
    from benchlib.measure.devices import heap_trim_available

    steps = len(batches) - alloc_steps
    if steps <= warmup:
        raise ValueError(f"need more steps than warm-up steps ({warmup}), got {steps} timed steps")
    loss = np.zeros(steps)
    labels = dict(labels or {}) | {"loadavg_1m_before": load_average(), "torch_threads": torch.get_num_threads()}
    if device.kind == "cpu":
        labels["peak_after_malloc_trim"] = heap_trim_available()

    def one_step(step):
        idx = batches[step]
        losses = strategy.step(x_all[idx], y_all[idx])
        policy.after_step(step)
        return losses

    def keep_loss(step, losses):
        loss[step] = float(losses.mean())

    with policy:
        timed = measure_steps(one_step, steps, device=device, after_step=keep_loss)
    peak = math.nan if timed.peak_bytes is None else timed.peak_bytes
    step_s, gc_count, gc_s = (np.asarray(v, dtype=float) for v in (timed.step_s, timed.gc_count, timed.gc_s))
    generations = list(timed.gc_generations)
    result = TrainResult(strategy.name, labels, step_s, gc_count, gc_s, generations, loss, warmup,
                         peak_bytes=float(peak))
    if alloc_steps:
        extra = batches[steps:]

        def allocation_pass():
            for idx in extra:
                strategy.step(x_all[idx], y_all[idx])
            device.synchronize()

        allocs = count_allocations(allocation_pass, device)
        result.alloc_count_per_step = allocs.count / alloc_steps
        result.alloc_bytes_per_step = allocs.bytes / alloc_steps
        result.alloc_source = allocs.source
        result.labels["alloc_source"] = allocs.source
    return result


def load_average() -> float:
    """The 1-minute load average where the OS reports one (NaN elsewhere): on a shared machine
    it says how much of a step-time spike may be other processes."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


@contextlib.contextmanager
def long_lived_heap(data, count: int):
    """Hold ``count`` samples as ``(tensor, label)`` tuples while the block runs (see
    `MNISTData.as_sample_tuples`); yields the list so it stays referenced."""
    heap = data.as_sample_tuples(count) if count else []
    try:
        yield heap
    finally:
        heap.clear()


def run_grid(
    data,
    *,
    device,
    config: EnsembleConfig = EnsembleConfig(),
    strategies=STRATEGIES,
    gc_policies=GC_POLICIES,
    heap_sizes=(0,),
    steps: int = 60,
    warmup: int = 5,
    alloc_steps: int = 3,
    manual_every: int = 10,
    manual_generation: int = 2,
    steps_per_strategy: dict | None = None,
    progress=None,
    sweep: str | None = None,
) -> list[TrainResult]:
    """Every strategy x GC policy x heap size, each from the same initial parameters and batches.

    ``sweep`` names a side experiment (e.g. "threads") in the labels and case names, so its cells
    never share a case name with the main grid's.

    ``steps_per_strategy`` overrides ``steps`` for named strategies (a per-net step trains
    the nets one by one and is 20-30x slower; a shorter run of it still shows its distribution). ``progress`` is called
    with each finished result.
    """
    unknown = [s for s in strategies if s not in STRATEGY_CLASSES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; valid: {', '.join(STRATEGIES)}")
    bad_policies = [p for p in gc_policies if p not in GC_POLICIES]
    if bad_policies:
        raise ValueError(f"unknown GC policies {bad_policies}; valid: {', '.join(GC_POLICIES)}")
    bad_heaps = [h for h in heap_sizes if not isinstance(h, int) or not 0 <= h <= len(data)]
    if bad_heaps:
        raise ValueError(f"heap sizes must be integers in 0..{len(data)} (samples held as tuples), got {bad_heaps}")
    steps_per_strategy = dict(steps_per_strategy or {})
    if set(steps_per_strategy) - set(STRATEGIES):
        raise ValueError(f"steps_per_strategy names unknown strategies; valid: {', '.join(STRATEGIES)}")
    for name in strategies:
        if steps_per_strategy.get(name, steps) <= warmup:
            raise ValueError(f"{name}: steps must exceed warmup ({warmup})")
    torch_device = device.torch
    _use_vmap_once()
    x_all, y_all = data.as_float_tensors(torch_device)
    init = initial_parameters(config)
    longest = max(steps_per_strategy.get(s, steps) for s in strategies)
    all_batches = minibatch_indices(len(data), config.batch, longest + alloc_steps, config.seed).to(torch_device)
    results = []
    for heap_size in heap_sizes:
        with long_lived_heap(data, heap_size):
            for policy_name in gc_policies:
                for name in strategies:
                    n_steps = steps_per_strategy.get(name, steps)
                    batches = torch.cat([all_batches[:n_steps], all_batches[longest:longest + alloc_steps]])
                    strategy = make_strategy(name, init, config, device)
                    policy = GCPolicy(name=policy_name, every=manual_every, generation=manual_generation,
                                      cuda=device.kind == "cuda")
                    labels = asdict(config) | data.describe() | policy.describe() | {
                        "strategy": name, "optimizer": strategy.optimizer, "heap_objects": heap_size,
                        "steps": n_steps, "warmup": warmup, "alloc_steps": alloc_steps,
                        "params_per_net": config.params_per_net, "sweep": sweep,
                        "device": device.name,
                    }
                    try:
                        result = train(strategy, x_all, y_all, batches, device=device, policy=policy,
                                       warmup=warmup, alloc_steps=alloc_steps, labels=labels)
                    finally:
                        strategy.close()
                    results.append(result)
                    if progress is not None:
                        progress(result)
    return results


def thread_sweep(
    data,
    *,
    device,
    thread_counts,
    config: EnsembleConfig = EnsembleConfig(),
    strategy: str = "batched_hand",
    gc_policy: str = "freeze",
    steps: int = 200,
    warmup: int = 5,
    progress=None,
) -> list[TrainResult]:
    """One cell at several torch intra-op thread counts.

    A step of a few milliseconds can wait on a thread pool's wake-up, which a busy or small
    machine delays now and then: that moves p99, not the median, so the fastest strategy's
    spread is worth measuring against the thread count. torch's setting is restored afterwards.
    """
    bad = [n for n in thread_counts if not isinstance(n, int) or n < 1]
    if bad or not thread_counts:
        raise ValueError(f"thread_counts must be a non-empty list of integers >= 1, got {list(thread_counts)}")
    from benchlib.measure import torch_threads

    results = []
    for count in thread_counts:
        with torch_threads(count):
            results += run_grid(data, device=device, config=config, strategies=(strategy,), gc_policies=(gc_policy,),
                                heap_sizes=(0,), steps=steps, warmup=warmup, alloc_steps=0, progress=progress,
                                sweep="threads")
    return results


def _use_vmap_once() -> None:
    """Call ``torch.func.vmap`` once before any cell. From its first use in a process on, torch
    makes one more allocation per operator call (memray: about 10,000 more per naive step of
    200 nets), so without this the cells before the first ``batched_vmap`` cell would count
    fewer allocations than the same cells after it."""
    torch.func.vmap(torch.neg)(torch.zeros(1, 1))


def summary_frame(results: list[TrainResult]):
    """One row per cell: strategy, policy, heap, data and the summary metrics (a table to show)."""
    import pandas as pd

    rows = [{"strategy": r.strategy, "gc_policy": r.labels["gc_policy"], "heap_objects": r.labels["heap_objects"],
             "torch_threads": r.labels["torch_threads"], "data": r.labels["data"], **r.summary()} for r in results]
    return pd.DataFrame(rows)


def steps_frame(results: list[TrainResult]):
    """One row per step of every cell (step, time, GC pauses and their generations, loss)."""
    import pandas as pd

    frames = []
    for r in results:
        frames.append(pd.DataFrame({
            "strategy": r.strategy, "gc_policy": r.labels["gc_policy"], "heap_objects": r.labels["heap_objects"],
            "data": r.labels["data"], "step": np.arange(len(r.step_s)), "step_s": r.step_s,
            "gc_count": r.gc_count, "gc_s": r.gc_s,
            "gc_generations": [",".join(map(str, g)) for g in r.gc_generations],
            "loss": r.loss, "warmup": np.arange(len(r.step_s)) < r.warmup,
        }))
    return pd.concat(frames, ignore_index=True)


def matmul_flops(device, n: int = 1024, repeats: int = 5) -> float:
    """Measured float32 torch matmul FLOP/s on ``device`` when the run has no calibration records:
    the calibration workload's own measurement (same method), read the same way."""
    from benchlib.results import records_frame
    from benchlib.workloads import calibration

    rows = calibration.matmul_flops(device, sizes=[n], dtypes=["float32"], repeats=repeats)
    return calibration_flop_rate(records_frame(rows), device.name)


def calibration_flop_rate(records, device_name: str) -> float | None:
    """Best median float32 torch matmul FLOP/s in a run's calibration records (the calibration
    notebook's ``flop_rate`` rows) on ``device_name``; None when the run has none."""
    if records is None or len(records) == 0:
        return None
    rows = records[(records["benchmark"] == "calibration") & (records["metric"] == "flop_rate")
                   & (records["variant"] == "torch") & (records["dtype"] == "float32")
                   & (records["device"] == device_name)]
    if rows.empty:
        return None
    return float(rows.groupby("params")["value"].median().max())


def flop_floor(config: EnsembleConfig, flop_rate: float) -> dict:
    """The FLOP floor of one ensemble step at ``flop_rate`` FLOP/s, and the throughput ceiling."""
    flops_per_step = config.n_nets * config.batch * config.flops_per_model_sample
    return {"flop_rate": flop_rate, "flops_per_model_sample": config.flops_per_model_sample,
            "flops_per_step": flops_per_step, "floor_step_s": flops_per_step / flop_rate,
            "ceiling_model_samples_per_s": flop_rate / config.flops_per_model_sample}


def full_collection_pauses(data, heap_sizes=(0, 60000), repeats: int = 5):
    """Median pause of ``gc.collect()`` with ``heap_sizes`` samples held as tuples, with and
    without ``gc.freeze()``: what a full collection costs when it walks the long-lived heap.
    ``tracked_objects`` is how many objects that collection walks (``gc.get_objects()``, which
    leaves out the frozen ones)."""
    import pandas as pd

    from benchlib.measure import GCMonitor

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    rows = []
    for heap_size in heap_sizes:
        with long_lived_heap(data, heap_size):
            for frozen in (False, True):
                gc.collect()
                if frozen:
                    gc.freeze()
                tracked = len(gc.get_objects())
                try:
                    with GCMonitor() as monitor:
                        for _ in range(repeats):
                            gc.collect()
                finally:
                    if frozen:
                        gc.unfreeze()
                full = [duration for _, duration, generation in monitor.pauses if generation == 2]
                rows.append({"heap_objects": heap_size, "frozen": frozen, "tracked_objects": tracked,
                             "pause_s": float(np.median(full)),
                             "pause_max_s": float(np.max(full)), "repeats": repeats, "data": data.source})
    return pd.DataFrame(rows)


def collection_pause_records(pauses, device, labels: dict) -> list[dict]:
    """Tidy rows of `full_collection_pauses` (collector ``python-gc``)."""
    rows = []
    for row in pauses.itertuples():
        common = dict(benchmark=BENCHMARK, case=f"gc.collect|heap={row.heap_objects}|frozen={row.frozen}",
                      collector="python-gc", device=device, dtype="float32",
                      params=labels | {"heap_objects": row.heap_objects, "frozen": row.frozen, "repeats": row.repeats})
        rows.append(make_record(metric="full_gc_pause_median", value=row.pause_s, unit="s", **common))
        rows.append(make_record(metric="full_gc_pause_max", value=row.pause_max_s, unit="s", **common))
        rows.append(make_record(metric="tracked_objects", value=row.tracked_objects, unit="count", **common))
    return rows


def flop_floor_records(floor: dict, device, labels: dict) -> list[dict]:
    """Tidy rows of `flop_floor` (case and bound ``flop_floor``)."""
    common = dict(benchmark=BENCHMARK, case="flop_floor", bound="flop_floor", device=device, dtype="float32",
                  params=labels | floor)
    return [make_record(metric=metric, value=floor[metric], unit=unit, **common)
            for metric, unit in (("flop_rate", "FLOP/s"), ("floor_step_s", "s"),
                                 ("ceiling_model_samples_per_s", "model-samples/s"))]
