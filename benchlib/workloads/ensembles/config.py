"""The ensemble's shape and optimiser settings and its seeded initial parameters (the minibatch
order, shared with `lenet`, is `benchlib.workloads.ensembles.common`'s)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchlib.errors import Refused

if TYPE_CHECKING:  # imported where the nets are made, not where the benchmark is declared
    import torch

MODES = ("sequential", "threads", "vmap")  # how the 5 LeNet5s train (`lenet`)

STRATEGIES = ("naive", "buffers_reused", "step_in_backward", "batched_vmap", "batched_hand", "batched_fused")


GC_POLICIES = ("default", "freeze", "thresholds", "manual")
DEFAULT_POLICY = GC_POLICIES[0]  # the interpreter's own collector, untouched


# The `thresholds` policy: generation 0 collected after 100,000 net new container objects instead of
# 700, the others after 50 and 100 younger collections instead of 10 and 10.
RAISED_THRESHOLDS = (100_000, 50, 100)


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
                raise Refused(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise Refused(f"lr must be a positive number, got {self.lr!r}")

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
    import torch

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
