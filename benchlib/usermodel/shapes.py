"""A model file's pieces built from shapes alone, where nothing needs their values: a prediction for a GPU
(`benchlib fit --device cuda` without one) asks about models larger than this machine's memory, so their model is
built on the meta device and their tensors are fake (torch's FakeTensorMode), and no byte of them is taken."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def materialized(build: Callable[[], Any]):
    """The model built on the meta device and materialized where it is asked (fake tensors under a fake mode), its
    tied weights tied again: a model that deep-copies its layers as it is built (nn.TransformerEncoder) would
    otherwise hold parameters of another fake mode, which torch refuses to mix. A model that cannot be built on
    the meta device (its construction reads values) is built as it is."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - the file's own construction: built under the mode instead
        return build()
    tied = _tied_places(model)
    # `to_empty`, from shapes alone: the meta tensors are no input a strict fake mode refuses
    model = model._apply(lambda tensor: torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"))
    for (owner, name), *others in tied:  # `to_empty` gives each place a tensor of its own: tied again
        for module, other in others:
            setattr(module, other, getattr(owner, name))
    return model


def _tied_places(model) -> list[list[tuple]]:
    """(module, attribute) pairs that hold one parameter or buffer between them (a language model's embedding
    and output weights), each group listed once."""
    places: dict[int, list[tuple]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is not None and (module, name) not in places.get(id(tensor), []):
                    places.setdefault(id(tensor), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]
