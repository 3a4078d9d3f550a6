"""One training step of a model, run the way a combination of techniques says.

The step is eager torch's, `loss(model, *batch).backward()` then the optimizer's step, with each
technique's changes applied: its set-up first (`Technique.prepare`, in the registry's order), then,
per (micro-)batch, the forward under every technique's context and the gradient by the technique
owning it (or autograd's backward), then the optimizer (the file's, unless a technique owns it). Every
step ends with no gradient held, so steps do not accumulate. An error that is a technique's own limit
(torch says it cannot) is `NotApplicable`, never the file's failure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from benchlib.engines.techniques.base import Aspect, Combination, TechniqueOptions, backward, combine

if TYPE_CHECKING:  # torch is imported where a step runs, not where a run is planned
    import torch

Observer = Callable[[str, "torch.Tensor"], None]


class Step:
    """One training step under `combination`; calling it runs forward, backward and (if any) the optimizer
    step, or, given the file's own `step`, that step as written (by techniques that can: `runs_file_step`).

    `observe(fn)` calls `fn(name, gradient)` as each parameter's gradient is complete, for one extra step
    outside the measured ones: the gradient check and the gradient role read it.
    """

    def __init__(self, combination: Combination | str, model: torch.nn.Module, batch: tuple, loss: Callable,
                 optimizer: Callable | None, step: Callable | None = None, options: TechniqueOptions = TechniqueOptions()):
        if isinstance(combination, str):  # a name of benchlib's or installed techniques, joined by "+"
            from benchlib.engines.techniques import technique_registry

            combination = combine(combination, technique_registry(), options)
        self.combination, self.engine = combination, combination.name
        self.model, self.batch, self.loss, self.step = model, batch, loss, step
        self.optimizer_factory = optimizer
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.observer: Observer | None = None
        self.parts: list[tuple[tuple, float]] = [(batch, 1.0)]  # (micro-)batches and their losses' scale
        self.final_pass = True  # False while a micro-batch other than the last runs: its gradients are partial
        self.forward: Callable = functools.partial(self.contextual_loss, model)
        self.compile_s: float | None = None
        first = next((p for _, p in self.named), None)
        self.device_type = first.device.type if first is not None else "cpu"
        self.device = str(first.device) if first is not None else "cpu"
        self.owns_optimizer = combination.owner(Aspect.OPTIMIZER) is not None
        self.optimizers = [optimizer(p for _, p in self.named)] if optimizer is not None and not self.owns_optimizer \
            else []
        owner = combination.owner(Aspect.GRADIENT)
        self.differentiate = owner.differentiate if owner is not None else backward
        for technique in combination.parts:
            technique.prepare(self)

    @contextmanager
    def forward_contexts(self) -> Iterator[None]:
        """Every technique's forward context, entered in the registry's order."""
        with ExitStack() as stack:
            for technique in self.combination.parts:
                stack.enter_context(technique.forward_context(self))
            yield

    def contextual_loss(self, model: torch.nn.Module, *batch):
        """The file's loss with the forward under every technique's context."""
        with self.forward_contexts():
            return self.loss(model, *batch)

    def first_call(self, call: Callable[[], object]) -> float:
        """Seconds of a compiling first call made in the set-up (so no measured step pays it); its gradients
        are dropped."""
        from benchlib.engines import compiling

        try:
            return compiling.compile_first_call(call, self.device)
        finally:
            for _, p in self.named:
                p.grad = None

    def __call__(self) -> None:
        from benchlib.measure.case_child import NotApplicable

        try:
            self._run()
        except NotApplicable:
            raise
        except Exception as error:
            reason = self.combination.limit(error)
            if reason is not None:
                raise NotApplicable(reason) from error
            raise

    def _run(self) -> None:
        if self.step is not None:  # the file's own step: backward, clipping, the optimizer's step, as written
            with self.forward_contexts():
                self.step(self.model, self.optimizers[0] if self.optimizers else None, *self.batch)
            self._drop_gradients()
            return
        for index, (batch, scale) in enumerate(self.parts):
            self.final_pass = index == len(self.parts) - 1
            self.differentiate(self, batch, scale)
        if self.owns_optimizer:
            return
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self._drop_gradients()

    def _drop_gradients(self) -> None:
        for _, p in self.named:
            p.grad = None

    def _observed(self, fn: Observer, name: str, parameter: torch.Tensor) -> None:
        if self.final_pass:  # a post-accumulate-grad hook must return None
            fn(name, parameter.grad)

    @contextmanager
    def observe(self, fn: Observer) -> Iterator[None]:
        handles = []
        if not self.combination.observes_gradients:  # gradients accumulate in eager autograd (a compiled backward
            # is one node of it): post-accumulate hooks see each complete
            handles = [p.register_post_accumulate_grad_hook(functools.partial(self._observed, fn, name))
                       for name, p in self.named]
        self.observer = fn
        try:
            yield
        finally:
            self.observer = None
            for handle in handles:
                handle.remove()
