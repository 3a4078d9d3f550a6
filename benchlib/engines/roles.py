"""Where an engine's memory goes, by role: forward values saved for the backward pass, gradient
buffers, and the rest (what the allocator holds beyond both).

benchlib's engines know both roles exactly from their tape: at the instant of their largest sum
(the peak metrics) and live while a call runs (the gauge a role timeline reads). torch engines
show their saved tensors through `torch.autograd.graph.saved_tensors_hooks`: the distinct
storages autograd packs, inputs excluded (the caller's), each counted from its packing until
autograd releases it; their gradient buffers stay in "other". Hand-written gradients and HIPS
autograd expose neither, so all their memory is "other".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from benchlib.engine_names import TORCH_AUTOGRAD
from benchlib.records.metrics import GRADIENT_ROLE, SAVED_ROLE

SAVED_METRIC = "role_saved_bytes"
GRADIENT_METRIC = "role_gradient_bytes"
PARAMETER_METRIC = "role_parameter_bytes"  # a model file's parameters, held before every step
OPTIMIZER_METRIC = "role_optimizer_bytes"  # its optimizer's state, likewise


def tape_roles(gradient: Callable) -> dict[str, float]:
    """The role metrics a benchlib engine's tape kept of its last call, free to read; {} for any other engine."""
    stats = getattr(gradient, "stats", None)
    if stats is None:
        return {}
    return {SAVED_METRIC: float(stats.saved_bytes_at_peak_total), GRADIENT_METRIC: float(stats.live_bytes_at_peak_total)}


def role_gauge(engine, gradient: Callable, inputs: tuple = ()):
    """A `Case.roles` for `engine`'s gradient function: a factory of a context manager whose value
    reads the bytes held by role now; None for engines that expose no roles."""
    if hasattr(gradient, "stats"):
        return lambda: TapeCounters(gradient)
    if engine.name in TORCH_AUTOGRAD:
        return lambda: SavedTensors(inputs)
    return None


class TapeCounters:
    """Context manager whose value reads the running call's tape counters (benchlib's engines keep them
    anyway). It is `passive`: reading changes nothing in the call, so a measured call can carry it."""

    passive = True

    def __init__(self, gradient):
        self.gradient = gradient

    def read(self) -> dict[str, int]:
        stats = self.gradient.stats  # a new object per call: always the running call's counters
        if stats is None:
            return {SAVED_ROLE: 0, GRADIENT_ROLE: 0}
        return {SAVED_ROLE: stats.saved_bytes, GRADIENT_ROLE: stats.live_bytes}

    def __enter__(self) -> Callable[[], dict[str, int]]:
        return self.read

    def __exit__(self, *exc) -> None:
        return None


def local_storage(tensor):
    """The storage of `tensor`'s bytes on this rank: a sharded tensor's (DTensor's) local shard, whose wrapper
    would report the whole tensor's size."""
    to_local = getattr(tensor, "to_local", None)
    return (tensor if to_local is None else to_local()).untyped_storage()


class SavedTensors:
    """Context manager: counts the bytes of the storages torch autograd holds for backward,
    exactly, while it is active (views of one storage count once; `inputs`' storages not at all).

    Each packed tensor is wrapped in a small holder; autograd drops the holder when it releases
    the saved tensor (after the node's backward ran, or with its graph), and the holder's
    finalizer uncounts it. Its value, a gauge, gives {"saved": bytes now}; `peak_bytes` the most
    held at once. Tensors saved inside a region with its own hooks (torch.utils.checkpoint's) are
    that region's, not seen here. Not `passive`: its hooks run Python in every save, so it never rides
    on a measured call.
    """

    passive = False

    def __init__(self, inputs: tuple = (), where: Callable[[], str] | None = None,
                 parameters: Callable[[], Iterable] | None = None):
        self.excluded = {local_storage(tensor).data_ptr() for tensor in inputs}
        self.parameters = parameters  # the module's parameters now: FSDP's gathered ones are no activations
        self.blocks: dict[int, list] = {}  # data_ptr -> [holders, nbytes, place]
        self.bytes = 0
        self.peak_bytes = 0
        self.places = Places(where)
        self._hooks = None

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or (self.parameters is not None and key in {
                local_storage(p).data_ptr() for p in self.parameters()}):
            return tensor
        entry = self.blocks.get(key)
        if entry is None:
            place = self.places.add(storage.nbytes())
            self.blocks[key] = [1, storage.nbytes(), place]
            self.bytes += storage.nbytes()
            if self.bytes > self.peak_bytes:
                self.peak_bytes = self.bytes
                self.places.at_peak()
        else:
            entry[0] += 1
        return _Held(tensor, self, key)

    def _release(self, key: int) -> None:
        entry = self.blocks[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.blocks[key]
            self.bytes -= entry[1]
            self.places.remove(entry[2], entry[1])

    def read(self) -> dict[str, int]:
        return {SAVED_ROLE: self.bytes}

    def metrics(self) -> dict[str, float]:
        """The role metric of the calls made while active: the most bytes saved at once."""
        return {SAVED_METRIC: float(self.peak_bytes)}

    def __enter__(self) -> Callable[[], dict[str, int]]:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda packed: packed.tensor if isinstance(packed, _Held) else packed)
        self._hooks.__enter__()
        return self.read

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor as autograd holds it while SavedTensors counts it."""

    __slots__ = ("tensor", "counter", "key")

    def __init__(self, tensor, counter: SavedTensors, key: int):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self):
        self.counter._release(self.key)


class Places:
    """Bytes by place (a module path, say), and a copy taken when the role's total reached its most, so the
    places of a role's peak sum to it. `where()` names the place of what is added now; without it, nothing
    is kept by place."""

    def __init__(self, where: Callable[..., str] | None = None):
        self.where = where
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def add(self, nbytes: int, *of) -> str | None:
        if self.where is None:
            return None
        place = self.where(*of)
        self.now[place] = self.now.get(place, 0) + nbytes
        return place

    def remove(self, place: str | None, nbytes: int) -> None:
        if place is not None:
            self.now[place] -= nbytes

    def at_peak(self) -> None:
        if self.where is not None:
            self.peak = {place: nbytes for place, nbytes in self.now.items() if nbytes}


class LiveBytes:
    """The bytes of distinct tensor storages handed to `add` that are still alive, and the most at once: the
    gradient role of a step, fed by its gradient observer. `where(name)` places each by its parameter's name."""

    def __init__(self, where: Callable[[str], str] | None = None):
        self.live: dict[int, tuple[int, str | None]] = {}
        self.bytes = self.peak_bytes = 0
        self.places = Places(where)

    def add(self, name: str, tensor) -> None:
        import weakref

        storage = local_storage(tensor)
        key = storage.data_ptr()
        if key in self.live:
            return
        nbytes = storage.nbytes()
        self.live[key] = nbytes, self.places.add(nbytes, name)
        self.bytes += nbytes
        if self.bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
            self.places.at_peak()
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        nbytes, place = self.live.pop(key, (0, None))
        self.bytes -= nbytes
        self.places.remove(place, nbytes)
