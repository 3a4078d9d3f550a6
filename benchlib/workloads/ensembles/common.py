"""What the ensembles' two workloads share (the 200 small nets and `lenet`): the benchmark name their
records carry, the seeded minibatch order, and the machine's load average at a cell's start. It imports
nothing of the package, so the package's __init__ (whose `study` imports `lenet`) may import it first.
"""

from __future__ import annotations

import math
import os

from typing import TYPE_CHECKING

from benchlib.errors import Refused

import numpy as np

if TYPE_CHECKING:  # imported where the nets train, not where the benchmark is declared
    import torch

NAME = "mnist_ensembles"


def minibatch_indices(n_samples: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """(steps, batch) sample indices: epochs of seeded permutations, shared by every strategy."""
    import torch

    if n_samples < batch:
        raise Refused(f"the dataset has {n_samples} samples, fewer than one batch of {batch}")
    rng = np.random.default_rng(seed)
    per_epoch = n_samples // batch
    epochs = -(-steps // per_epoch)
    rows = [rng.permutation(n_samples)[: per_epoch * batch].reshape(per_epoch, batch) for _ in range(epochs)]
    return torch.from_numpy(np.concatenate(rows)[:steps].astype(np.int64))


def load_average() -> float:
    """The 1-minute load average where the OS reports one (NaN elsewhere): on a shared machine
    it says how much of a step-time spike may be other processes."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan
