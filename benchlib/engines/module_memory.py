"""Where a step's memory lives in the model's own structure: bytes by module path and role.

Parameters, their gradients and the optimizer state belong to the module that owns the parameter;
activations saved for backward belong to the innermost module whose forward was running when autograd
packed them; what is saved outside every module's forward (the loss) belongs to `NO_MODULE`. A storage
is counted once, by its first owner. Paths are cut at a depth (`analysis.module_paths`), where an index
joins the name of its container (`encoder.layers.3` is two levels), so a stack of blocks reads block by
block. A compiled step runs its modules inside one graph, where no module's hook fires: what it saves
belongs to `COMPILED`.

The running module is kept by global forward hooks keyed by module object, not by
`torch.utils.module_tracker.ModuleTracker`: that names modules after the first one it meets, which is a
technique's wrapper (torch.compile's, torch.func's) rather than the user's model, so its names would not
be the model's paths. The independent check in the tests uses ModuleTracker itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from benchlib.errors import Refused
from benchlib.analysis.module_paths import NO_MODULE, cut_path
from benchlib.engines.roles import local_storage
from benchlib.records.metrics import MODULE_METRIC

DEFAULT_DEPTH = 2


class ModulePaths:
    """The user's model's module paths at one depth: who owns each parameter, and which module runs now."""

    def __init__(self, model, depth: int = DEFAULT_DEPTH, outside: str = NO_MODULE):
        if depth < 1:
            raise Refused(f"module depth must be 1 or more (levels below the model), got {depth}")
        self.depth = depth
        self.of_module = {id(module): cut_path(path, depth) for path, module in model.named_modules()}
        self.of_parameter: dict[int, str] = {}  # storage pointer -> owning path: a tied parameter's first owner
        for path, module in model.named_modules():
            for _, parameter in module.named_parameters(recurse=False):
                self.of_parameter.setdefault(local_storage(parameter).data_ptr(), cut_path(path, depth))
        self.running: list[str] = []
        self.outside = outside  # the place of what is saved while none of the model's modules runs

    def parameter_owner(self, tensor) -> str:
        return self.of_parameter.get(local_storage(tensor).data_ptr(), NO_MODULE)

    def innermost(self) -> str:
        return self.running[-1] if self.running else self.outside

    def _enter(self, module, _inputs) -> None:
        path = self.of_module.get(id(module))
        if path is not None:
            self.running.append(path)

    def _leave(self, module, _inputs, _output) -> None:
        if id(module) in self.of_module and self.running:
            self.running.pop()

    @contextmanager
    def tracking(self) -> Iterator[Callable[[], str]]:
        """While active, `innermost()` names the innermost of the model's modules running its forward."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles = (register_module_forward_pre_hook(self._enter), register_module_forward_hook(self._leave))
        try:
            yield self.innermost
        finally:
            for handle in handles:
                handle.remove()
            self.running.clear()


def held_by_module(owned) -> dict[str, int]:
    """Bytes of the distinct storages of `owned` (owner, tensor) pairs by owner, a storage counted for its first:
    parameters and optimizer state."""
    seen: dict[int, tuple[str, int]] = {}
    for owner, tensor in owned:
        storage = local_storage(tensor)
        seen.setdefault(storage.data_ptr(), (owner, storage.nbytes()))
    out: dict[str, int] = {}
    for path, nbytes in seen.values():
        out[path] = out.get(path, 0) + nbytes
    return out


def module_rows(by_role: dict[str, dict[str, float]], depth: int) -> list[dict]:
    """The breakdown rows a case's check hands its records: one per (module, role) holding bytes."""
    return [{"metric": MODULE_METRIC, "value": float(nbytes),
             "params": {"module": module, "role": role, "module_depth": depth}}
            for role, by_module in by_role.items() for module, nbytes in by_module.items() if nbytes > 0]
