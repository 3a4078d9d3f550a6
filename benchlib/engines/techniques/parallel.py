"""Steps on several torch.distributed ranks: data parallel (`ddp`) and fully sharded (`fsdp`).

A parallel strategy is the technique that owns PLACEMENT: where each rank holds the model. It joins the
others with `+` (`fsdp+torch-checkpoint`, `ddp+torch-autocast`); the rest of the step is theirs. Each
rank's process joins its group first (`join_group`: gloo on the CPU, NCCL on CUDA, met through a file, so no
port is chosen: `RankGroup`), then builds its step (`benchlib.usermodel.ranked`). FSDP2 builds the model on the meta
device, shards each repeated block (the checkpoint targets) and the root, and only then materializes its
shard: built whole and then sharded, a rank would hold the whole model once (more than DDP's copy at its
peak). Rank 0 alone builds the seeded model whole, to broadcast the initial values from, as torch's recipe
for a full checkpoint does; that is set-up, before any measured step.

One rank can also be simulated in one process (`simulated_rank`): torch's fake process group, whose
collectives return at once, with fake tensors, so `benchlib fit --device cuda --ranks N` predicts what a rank
holds without N GPUs. There FSDP shards outside the fake tensor mode (its device mesh reads values) and
materializes fake shards; no values are loaded, as a trace needs only shapes. DDP's reducer, in C++, cannot
run on fake tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from benchlib.engine_names import DDP, FSDP
from benchlib.engines.techniques.base import Aspect, Need, Technique
from benchlib.engines.techniques.modules import checkpoint_blocks

if TYPE_CHECKING:  # torch is imported where ranks step, not where a run is planned
    import torch

COMMUNICATION_EVENTS = ("gloo:", "nccl:")  # torch.profiler's names of a collective's own work, by backend


@dataclass(frozen=True)
class RankGroup:
    """Who this process is among the ranks of one step, where they meet (a file), and how long a collective waits
    for the others: what `benchlib.measure.run_ranks` hands each rank as its `group` param."""

    rank: int
    world_size: int
    rendezvous: str
    timeout_s: float

    def join(self, device: torch.device) -> None:
        """Join the group: gloo on the CPU, NCCL on CUDA."""
        import torch
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.FileStore(self.rendezvous, self.world_size), rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=self.timeout_s))


@contextlib.contextmanager
def simulated_rank(world_size: int) -> Iterator[None]:
    """This process as rank 0 of `world_size` under torch's fake process group: every collective returns at once
    and moves nothing, so a step placed here holds what one rank holds (its shard, its buffers), not what it
    receives. Rank 0 holds the largest shard where a dimension does not split evenly (torch chunks it so)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _simulated() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "fake"


@contextlib.contextmanager
def storage_resizes(noted: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """`noted(tensor)` after FSDP2 resizes a gathered parameter's storage: to nothing once its block has run,
    back to whole when it gathers it again. No operator does it, so neither a dispatch mode nor a saved-tensor
    hook sees it; torch's two helpers (private) are wrapped for the block's time. A torch without them: nothing
    is noted."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param as fsdp_param
    except ImportError:
        yield
        return
    helpers = {name: getattr(fsdp_param, name, None) for name in ("alloc_storage", "free_storage")}
    if None in helpers.values():
        yield
        return

    def noting(helper):
        def resize(tensor):
            helper(tensor)
            noted(tensor)
        return resize

    for name, helper in helpers.items():
        setattr(fsdp_param, name, noting(helper))
    try:
        yield
    finally:
        for name, helper in helpers.items():
            setattr(fsdp_param, name, helper)


class GatheredBytes:
    """The bytes of parameters a rank holds gathered whole from every rank's shard, at their most over what it
    watches (`with gathered.watching(): step()`): FSDP2's unsharded parameters, each block's from its all-gather
    until it is resharded. `seen` is False where nothing was gathered (DDP, one process)."""

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary

        self.live = WeakIdKeyDictionary()  # storage -> its bytes now (torch keeps a storage's Python object)
        self.peak = 0
        self.seen = False

    def _noted(self, tensor: torch.Tensor) -> None:
        self.seen = True
        self.live[tensor.untyped_storage()] = tensor.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(self.live.values()))

    @contextlib.contextmanager
    def watching(self) -> Iterator[GatheredBytes]:
        with storage_resizes(self._noted):
            yield self


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective: every rank calls it in the same order); others as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return tensor if full_tensor is None else full_tensor()


def communication_share(call: Callable[[], object]) -> float:
    """The share of `call()` during which a collective was in flight (waiting for another rank included), as
    torch.profiler times the backend's own events against the span of everything it saw; collectives in flight
    at once count once."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        call()
    events = [(event.time_range.start, event.time_range.end, event.name) for event in profiler.events()]
    if not events:
        return 0.0
    spans = sorted((start, end) for start, end, name in events if name.startswith(COMMUNICATION_EVENTS))
    total, reached = 0.0, -math.inf
    for start, end in spans:
        total += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    whole = max(end for _, end, _ in events) - min(start for start, _, _ in events)
    return min(1.0, total / whole) if whole > 0 else 0.0


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a data-parallel wrapper (DDP's `module`), so its module paths are the file's own."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class DataParallel(Technique):
    name = DDP
    description = "DistributedDataParallel: the whole model on every rank, gradients all-reduced during backward"
    changes = frozenset({Aspect.PLACEMENT})
    needs = frozenset({Need.RANKS})
    imports = ("torch.distributed",)
    untraceable = ("DDP's reducer, in C++, cannot run on fake tensors, so no rank of it is simulated in one process; "
                   "it is measured on ranks")
    runs_file_step = True

    def place(self, build: Callable[[], torch.nn.Module], device: torch.device,
              computes_in: str | None = None) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(build().to(device), device_ids=[device] if device.type == "cuda" else None)


class FullyShard(Technique):
    name = FSDP
    description = ("FSDP2: fully_shard on each repeated block and the root, built on the meta device; parameters, "
                   "gradients and optimizer state sharded across ranks; with autocast, its mixed precision policy")
    changes = frozenset({Aspect.PLACEMENT})
    needs = frozenset({Need.RANKS})
    imports = ("torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict")
    runs_file_step = True

    def params(self, model: torch.nn.Module) -> dict:
        return {"sharded_modules": checkpoint_blocks(model)}

    def place(self, build: Callable[[], torch.nn.Module], device: torch.device,
              computes_in: str | None = None) -> torch.nn.Module:
        """Sharded per block and at the root; joined with autocast (`computes_in`), FSDP's mixed precision policy
        gathers the parameters in that dtype and reduces gradients in float32, as torch's recipe does."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy() if computes_in is None else \
            MixedPrecisionPolicy(param_dtype=getattr(torch, computes_in), reduce_dtype=torch.float32)
        with unset_fake_temporarily():  # the mesh and the shards' layout are made from real (meta) tensors
            model = _sharded_on_meta(build, policy)
        model.to_empty(device=device)  # under a fake tensor mode, fake shards: a trace needs no values
        if not _simulated():
            _load_from_rank0(model, build)
        return model


def _sharded_on_meta(build: Callable[[], torch.nn.Module], policy) -> torch.nn.Module:
    """The model built on the meta device, `fully_shard` on each repeated block (the checkpoint targets), then the
    root, under the mixed precision `policy`: no rank ever holds it whole."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from benchlib.measure.case_child import NotApplicable

    try:
        with torch.device("meta"):
            model = build()
    except Exception as error:
        raise NotApplicable(f"the model cannot be built on the meta device, which sharding it without a whole "
                            f"copy per rank needs: {type(error).__name__}: {error}") from error
    for path in checkpoint_blocks(model):
        fully_shard(model.get_submodule(path), mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _load_from_rank0(model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> None:
    """Every rank's shard of the seeded values rank 0 builds whole, and the buffers the state dict leaves out
    (non-persistent ones), broadcast from it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    whole = build() if dist.get_rank() == 0 else None
    set_model_state_dict(model, whole.state_dict() if whole is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    kept = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name not in kept:
            if whole is not None:
                buffer.copy_(whole.get_buffer(name))
            dist.broadcast(buffer, src=0)


PARALLEL = {technique.name: technique for technique in (DataParallel, FullyShard)}
