"""A loss over the model as one torch module, for the techniques that transform or compile the whole step
(torch.func, torch.compile). Its own module, imported where a step runs: the techniques' declarations, which a
run's planning reads, import no torch."""

from __future__ import annotations

import torch


class LossModule(torch.nn.Module):
    """A loss over the model as a module, so `functional_call` swaps the parameters the loss reads and
    torch.compile sees one module."""

    def __init__(self, model: torch.nn.Module, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *batch):
        return self.loss(self.model, *batch)
