"""The interface every step technique implements, and how techniques join into one step.

A technique is one class: it declares which parts of a training step it changes (`Aspect`), what it
needs, what it imports, whether a fake-tensor trace can follow it, and when it does not apply; at run
time it prepares the step and lends it a forward context, a batch split, an optimizer or its own way
to differentiate. Techniques join with `+` (`torch-autocast+torch-checkpoint`): two that change the
same exclusive aspect cannot, nor a pair one of them refuses (`Technique.refuses`). A `Combination`
is what a step runs, one technique or several; its facts are its parts' facts, joined.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from benchlib.errors import Refused
from benchlib.engine_names import COMBINED, TORCH

if TYPE_CHECKING:
    import torch


class StepView(Protocol):
    """What a technique's hooks read and set of the step that composes them (`benchlib.engines.techniques.step`)."""

    model: torch.nn.Module
    batch: tuple
    loss: Callable
    named: list[tuple[str, torch.Tensor]]  # the parameters that take gradients, by name
    parts: list[tuple[tuple, float]]  # (micro-)batches and their losses' scale
    forward: Callable  # batch -> loss, what backward differentiates
    optimizer_factory: Callable | None
    optimizers: list
    observer: Callable | None  # called with (name, gradient) as each gradient is complete, when set
    device_type: str
    compile_s: float | None

    def contextual_loss(self, model: torch.nn.Module, *batch: Any) -> torch.Tensor: ...

    def first_call(self, call: Callable) -> float: ...


class Aspect(str, Enum):
    """A part of a training step a technique changes. Forward contexts stack; every other aspect has
    one owner in a combination."""

    FORWARD = "the forward's context"
    SAVING = "what backward saves"
    BATCH = "how the batch is split"
    OPTIMIZER = "the optimizer step"
    GRADIENT = "how the gradient is computed"
    PLACEMENT = "where the parameters live across ranks"

    @property
    def exclusive(self) -> bool:
        return self is not Aspect.FORWARD


class Need(str, Enum):
    """What a technique needs of a model file or device."""

    OPTIMIZER = "an optimizer(parameters)"
    CUDA = "a CUDA device"
    FLOAT32 = "float32 parameters"
    RANKS = "several ranks (benchlib run --ranks N)"


@dataclass(frozen=True)
class TechniqueOptions:
    """The run's settings techniques read (`-p microbatches=K`, `-p sac_saved_ops=...`)."""

    microbatches: int = 4
    sac_saved_ops: tuple[str, ...] = ()  # empty: torch-sac's default policy

    def to_json(self) -> dict:
        return {"microbatches": self.microbatches, "sac_saved_ops": list(self.sac_saved_ops)}

    @classmethod
    def from_json(cls, data: dict | None) -> TechniqueOptions:
        data = data or {}
        return cls(int(data.get("microbatches", cls.microbatches)), tuple(data.get("sac_saved_ops") or ()))


@dataclass(frozen=True)
class StepFacts:
    """What a technique may ask of a model file before its step is built."""

    has_optimizer: bool
    has_step: bool  # the file defines its own step(model, optimizer, *batch)
    device_kind: str
    world_size: int = 1  # the ranks the step runs on (torch.distributed), 1 in one process


class Technique:
    """One way of changing a training step. Subclasses set the class attributes and override the hooks
    they need; everything else behaves as eager torch (`loss(model, *batch).backward()`, then the
    file's optimizer). A model file's `TECHNIQUES = {"name": Class}` adds its own (docs/techniques.md)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    changes: ClassVar[frozenset[Aspect]] = frozenset()
    needs: ClassVar[frozenset[Need]] = frozenset()
    imports: ClassVar[tuple[str, ...]] = ()  # modules its set-up or first step imports beyond torch
    untraceable: ClassVar[str | None] = None  # why a fake-tensor trace cannot follow its step; None: it can
    computes_in: ClassVar[str | None] = None  # the dtype its step computes in, where not the model's (autocast)
    regroups_optimizer: ClassVar[str | None] = None  # why its optimizer step is not the file's, where it replaces it
    observes_gradients: ClassVar[bool] = False  # it hands each complete gradient to `step.observer` itself
    hides_saved: ClassVar[str | None] = None  # why saved-tensor hooks cannot see what its backward saves
    runs_file_step: ClassVar[bool] = False  # it can run a file's own step(model, optimizer, *batch) as written
    takes_modules: ClassVar[bool] = False  # its name may say the modules it acts on: torch-checkpoint[encoder.layers.0-5]

    def __init__(self, options: TechniqueOptions = TechniqueOptions()):
        self.options = options
        self.modules: tuple[str, ...] = ()  # the modules its name's bracket gave (`acting_on`); () where it chooses

    def acting_on(self, modules: tuple[str, ...]) -> Technique:
        """This technique on exactly `modules` (paths in the model), named with them in brackets."""
        from benchlib.engines.techniques.modules import module_spec

        self.modules = modules
        self.name = f"{type(self).name}[{module_spec(list(modules))}]"
        return self

    def not_applicable(self, model: torch.nn.Module, facts: StepFacts) -> str | None:
        """Why this technique cannot run this model's step, beyond its `needs`; None when it can."""
        return None

    def place(self, build: Callable[[], torch.nn.Module], device: torch.device,
              computes_in: str | None = None) -> torch.nn.Module:
        """The model its step runs on, built by `build()` (seeded, on the host) and put where this rank holds it:
        on `device` as a whole unless the technique owns PLACEMENT (data parallel, sharded). `computes_in`: the
        dtype another part computes the forward in (autocast's), which a placement may gather parameters in."""
        return build().to(device)

    def refuses(self, other: Technique) -> str | None:
        """Why this technique cannot join `other` beyond a shared aspect; None when it can."""
        return None

    def params(self, model: torch.nn.Module) -> dict:
        """What its records carry of how it ran on `model` (its checkpointed modules, its dtype)."""
        return {}

    def batch_multiple(self) -> int:
        """What every batch size it runs must be a multiple of (micro-batches split the batch evenly): a search
        over sizes (`benchlib fit`) asks only these."""
        return 1

    def prepare(self, step: StepView) -> None:
        """Change `step` at set-up: wrap modules, split the batch, make optimizers, compile."""

    def forward_context(self, step: StepView) -> AbstractContextManager:
        """The context the forward pass runs in (autocast, a saved-tensor hook)."""
        return nullcontext()

    def differentiate(self, step: StepView, batch: tuple, scale: float) -> None:
        """The gradient of one (micro-)batch into the parameters' `.grad`, called on the technique owning
        GRADIENT: autograd's backward of `step.forward` unless it overrides this (torch.func)."""
        backward(step, batch, scale)

    def limit(self, error: BaseException) -> str | None:
        """Where `error` is this technique's own limit (torch says it cannot), why it does not apply."""
        return None


def backward(step: StepView, batch: tuple, scale: float) -> None:
    """Eager autograd's gradient of one (micro-)batch, its loss scaled to the whole batch's."""
    loss = step.forward(*batch)
    (loss * scale if scale != 1.0 else loss).backward()


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class CombinationError(Refused):
    """A technique name that is not one, or techniques that cannot join; the message says what is valid."""


class Misnamed(ValueError):
    """What a technique was asked to act on is not in the model (a misspelt module path): an error of the request,
    so the steps that asked fail saying so, never a reason the technique does not apply (which leaves a run ok)."""


class TechniqueFault(RuntimeError):
    """One technique's own hook raised: a fault of that technique, which fails the steps it is part of, never the
    others' nor the model file's; or it was asked for what the model lacks (`Misnamed`), said in its own words."""

    def __init__(self, technique: Technique, hook: str, error: BaseException):
        super().__init__(f"{technique.name}: {error}" if isinstance(error, Misnamed) else
                         f"technique {technique.name}: its {hook} raised {type(error).__name__}: {first_line(error)}")


def _hook(technique: Technique, hook: str, *args: Any) -> Any:
    """`technique.hook(*args)`, a raise in it a `TechniqueFault` naming the technique."""
    try:
        return getattr(technique, hook)(*args)
    except Exception as error:  # noqa: BLE001 - any raise in a technique's own code is that technique's fault
        raise TechniqueFault(technique, hook, error) from error


@dataclass(frozen=True)
class Combination:
    """The techniques one step runs, in the registry's order (its name is theirs joined by `+`)."""

    parts: tuple[Technique, ...]

    @property
    def name(self) -> str:
        return COMBINED.join(part.name for part in self.parts)

    @property
    def combined(self) -> bool:
        return len(self.parts) > 1

    def owner(self, aspect: Aspect) -> Technique | None:
        return next((part for part in self.parts if aspect in part.changes), None)

    def _first(self, attribute: str) -> Any:
        return next((value for part in self.parts if (value := getattr(part, attribute)) is not None), None)

    @property
    def untraceable(self) -> str | None:
        return self._first("untraceable")

    @property
    def batch_multiple(self) -> int:
        return math.lcm(*(part.batch_multiple() for part in self.parts))

    @property
    def computes_in(self) -> str | None:
        """The dtype its gradient is judged in: of its parts' dtypes, the one with the loosest tolerance."""
        from benchlib.engines.gradients import gradient_tolerance

        dtypes = [part.computes_in for part in self.parts if part.computes_in is not None]
        return max(dtypes, key=lambda dtype: gradient_tolerance(dtype) or 0.0, default=None)

    @property
    def regroups_optimizer(self) -> str | None:
        return self._first("regroups_optimizer")

    @property
    def hides_saved(self) -> str | None:
        return self._first("hides_saved")

    @property
    def observes_gradients(self) -> bool:
        return any(part.observes_gradients for part in self.parts)

    def place(self, build: Callable[[], torch.nn.Module], device: torch.device) -> torch.nn.Module:
        """The model the step runs on, placed by the part that owns PLACEMENT (eager's placement without one), told
        the dtype the forward computes in where a part changes it."""
        placement = self.owner(Aspect.PLACEMENT) or Technique()
        dtype = self.computes_in
        return placement.place(build, device) if dtype is None else placement.place(build, device, computes_in=dtype)

    def imports(self, has_optimizer: bool) -> tuple[str, ...]:
        """What its step imports beyond torch the first time it runs (torch.optim imports the dynamo stack)."""
        from benchlib.engines import DYNAMO

        found = [name for part in self.parts for name in part.imports] + ([DYNAMO] if has_optimizer else [])
        return tuple(dict.fromkeys(found))

    def not_applicable(self, model: torch.nn.Module, facts: StepFacts) -> str | None:
        """Why this step cannot run on `model` (the first part that cannot, named where there are several)."""
        for part in self.parts:
            reason = _needs_missing(part, model, facts) or _hook(part, "not_applicable", model, facts)
            if reason is None and facts.has_step and not part.runs_file_step:
                reason = (f"the file's step(model, optimizer, *batch) runs its own forward and backward (and its "
                          f"optimizer's step); {part.name} ({part.description}) cannot run that step as written")
            if reason is not None:
                return f"{part.name}: {reason}" if self.combined else reason
        return None

    def params(self, model: torch.nn.Module) -> dict:
        params: dict = {"techniques": [part.name for part in self.parts]} if self.combined else {}
        for part in self.parts:
            params.update(_hook(part, "params", model))
        return params

    def limit(self, error: BaseException) -> str | None:
        """Why the step does not apply, where `error` is one of its techniques' limits."""
        for part in self.parts:
            reason = part.limit(error)
            if reason is not None:
                return f"{part.name}: {reason}" if self.combined else reason
        return None


def _needs_missing(part: Technique, model: torch.nn.Module, facts: StepFacts) -> str | None:
    if Need.OPTIMIZER in part.needs and not facts.has_optimizer:
        return f"the file declares no optimizer(parameters): {part.name} needs {Need.OPTIMIZER.value}"
    if Need.RANKS in part.needs and facts.world_size < 2:
        return f"{part.name} needs {Need.RANKS.value}; this run has one process"
    if Need.CUDA in part.needs and facts.device_kind != "cuda":
        return f"{part.name} needs {Need.CUDA.value} ({part.description})"
    if Need.FLOAT32 in part.needs:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        if dtype is not None and str(dtype) != "torch.float32":
            return (f"{part.name} needs {Need.FLOAT32.value} ({part.description}); this model's parameters are "
                    f"{str(dtype).removeprefix('torch.')}")
    return None


def refusal(first: Technique, second: Technique) -> str | None:
    """Why two techniques cannot join in one step, or None."""
    shared = [aspect for aspect in first.changes & second.changes if aspect.exclusive]
    if shared:
        what = ", ".join(sorted(aspect.value for aspect in shared))
        return f"{first.name} and {second.name} both change {what}"
    return _hook(first, "refuses", second) or _hook(second, "refuses", first)


def _bracketed(part: str) -> tuple[str, tuple[str, ...] | None]:
    """A technique's name and the modules its bracket names (`torch-checkpoint[blocks.0-2]`), None without one."""
    from benchlib.engines.techniques.modules import parse_module_spec

    if not part.endswith("]") or "[" not in part:
        return part, None
    base, _, spec = part[:-1].partition("[")
    try:
        return base.strip(), parse_module_spec(spec)
    except ValueError as error:
        raise CombinationError(f"{part!r}: {error}") from None


def combine(name: str, registry: dict[str, type[Technique]], options: TechniqueOptions = TechniqueOptions()
            ) -> Combination:
    """The combination `name` names (techniques joined by `+`), in the registry's order, or CombinationError
    saying what is valid."""
    given = [part.strip() for part in name.split(COMBINED)]
    names = [_bracketed(part)[0] for part in given]
    unknown = [part for part in names if part not in registry]
    if unknown or not names:
        where = "" if unknown == [name] else f"{name!r}: "
        raise CombinationError(f"{where}{', '.join(map(repr, unknown))} is no technique; valid: "
                               f"{', '.join(registry)}, or several joined by '{COMBINED}' "
                               f"(e.g. torch-autocast{COMBINED}torch-checkpoint)")
    if len(names) > 1 and TORCH in names:
        raise CombinationError(f"{name!r}: {TORCH} is the eager step every technique changes; join the others alone")
    if len(set(names)) < len(names):
        raise CombinationError(f"{name!r} names a technique twice")
    order = list(registry)
    parts = []
    for part in sorted(given, key=lambda part: order.index(_bracketed(part)[0])):
        base, modules = _bracketed(part)
        technique = registry[base](options)
        if modules is not None and not technique.takes_modules:
            takes = [each for each, kind in registry.items() if kind.takes_modules]
            raise CombinationError(f"{part!r}: {base} takes no modules in brackets; {', '.join(takes)} do "
                                   f"({takes[0] if takes else 'torch-checkpoint'}[encoder.layers.0-5])")
        parts.append(technique if modules is None else technique.acting_on(modules))
    parts = tuple(parts)
    for index, first in enumerate(parts):
        for second in parts[index + 1:]:
            reason = refusal(first, second)
            if reason is not None:
                raise CombinationError(f"{name!r} cannot run as one step: {reason}")
    return Combination(parts)

