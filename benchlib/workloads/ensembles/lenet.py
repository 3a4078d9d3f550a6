"""Workload B: five LeNet5 models trained together, the Flux thread's MWE.

The thread trains 5 LeNet5 (batch 128, Adam 3e-4) inside ``Threads.@threads`` and prints each
epoch with ``@time``: seconds, allocations, bytes, GC share. Here the five models train
(i) ``sequential``: one after another, (ii) ``threads``: five Python threads at once, like the MWE,
(iii) ``vmap``: parameters stacked, one ``vmap(functional_call)`` step trains all five.
All modes start from the same five initial models, take the same untimed warm-up step, and read
the same seeded minibatch order.

Per epoch (one step of `benchlib.measure.measure_steps`): wall time (device synchronised), GC pauses. Allocations come from a
separate pass of ``alloc_steps`` steps under `count_allocations` (tracing would distort the
epoch's time); the epoch's allocations are that per-step figure times the epoch's steps, an
estimate the @time line marks with ``~``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchlib.errors import Refused
from benchlib.records import make_record
from benchlib.workloads.ensembles.common import NAME, load_average, minibatch_indices
from benchlib.workloads.ensembles.config import MODES


@dataclass(frozen=True)
class LeNetConfig:
    """Five LeNet5s as in the MWE; ``step_limit`` caps the steps of an epoch (0: a full pass)."""

    n_models: int = 5
    batch: int = 128
    lr: float = 3e-4
    epochs: int = 2
    step_limit: int = 20
    seed: int = 0

    def __post_init__(self):
        for name in ("n_models", "batch", "epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise Refused(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.step_limit, int) or self.step_limit < 0:
            raise Refused(f"step_limit must be a non-negative integer (0: whole epochs), got {self.step_limit!r}")
        if not self.lr > 0:
            raise Refused(f"lr must be positive, got {self.lr!r}")


def lenet5() -> nn.Sequential:
    """LeNet5 for 28x28x1 inputs, the MWE's layers: 44,426 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, 10),
    )


def initial_models(config: LeNetConfig, device) -> list[nn.Sequential]:
    """``n_models`` LeNet5s from ``config.seed``: the same five for every mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return [lenet5().to(device) for _ in range(config.n_models)]


class _Trainer:
    """One mode's training loop over shared data; ``run(batches)`` trains every model on each
    minibatch in ``batches`` and returns the mean loss of the last step."""

    def __init__(self, config: LeNetConfig, x_all, y_all, device):
        self.config, self.x_all, self.y_all, self.device = config, x_all, y_all, device


class Sequential(_Trainer):
    def __init__(self, config, x_all, y_all, device):
        super().__init__(config, x_all, y_all, device)
        self.models = initial_models(config, device)
        self.opts = [torch.optim.Adam(m.parameters(), lr=config.lr) for m in self.models]

    def _train_one(self, index, batches, losses):
        model, opt = self.models[index], self.opts[index]
        loss = None
        for idx in batches:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(self.x_all[idx]), self.y_all[idx])
            loss.backward()
            opt.step()
        losses[index] = loss.item()

    def run(self, batches):
        losses = [math.nan] * self.config.n_models
        for index in range(self.config.n_models):
            self._train_one(index, batches, losses)
        return float(np.mean(losses))

    def stacked_parameters(self):
        return {name: torch.stack([dict(m.named_parameters())[name].detach().cpu() for m in self.models])
                for name, _ in self.models[0].named_parameters()}


class Threads(Sequential):
    """The MWE's ``Threads.@threads for p_i in 1:5``: one Python thread per model."""

    def run(self, batches):
        losses = [math.nan] * self.config.n_models
        errors = []

        def target(index):
            try:
                self._train_one(index, batches, losses)
            except BaseException as exc:  # re-raised in the caller below
                errors.append(exc)

        threads = [threading.Thread(target=target, args=(i,)) for i in range(self.config.n_models)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return float(np.mean(losses))


class Vmapped(_Trainer):
    """``stack_module_state`` + ``vmap(functional_call)``: one forward and backward for all models."""

    def __init__(self, config, x_all, y_all, device):
        super().__init__(config, x_all, y_all, device)
        params, _ = torch.func.stack_module_state(initial_models(config, device))
        self.params = {name: p.detach().clone().requires_grad_(True) for name, p in params.items()}
        base = lenet5().to("meta")

        def one_model(p, x):
            return torch.func.functional_call(base, p, (x,))

        self._forward = torch.func.vmap(one_model, in_dims=(0, None))
        try:
            self.opt = torch.optim.Adam(self.params.values(), lr=config.lr, fused=True)
        except (RuntimeError, ValueError):
            self.opt = torch.optim.Adam(self.params.values(), lr=config.lr, foreach=True)

    def run(self, batches):
        n = self.config.n_models
        losses = None
        for idx in batches:
            self.opt.zero_grad(set_to_none=False)
            logits = self._forward(self.params, self.x_all[idx])  # (n, B, 10)
            b = logits.shape[1]
            y = self.y_all[idx]
            losses = F.cross_entropy(logits.reshape(n * b, -1), y.repeat(n), reduction="none").view(n, b).mean(1)
            losses.sum().backward()
            self.opt.step()
        return losses.mean().item()

    def stacked_parameters(self):
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}


TRAINERS = {"sequential": Sequential, "threads": Threads, "vmap": Vmapped}


@dataclass
class EpochResult:
    mode: str
    epoch: int
    seconds: float
    gc_count: int
    gc_seconds: float
    loss: float
    steps: int
    alloc_count_est: float = math.nan
    alloc_bytes_est: float = math.nan
    alloc_count_python_est: float = math.nan

    @property
    def gc_share(self) -> float:
        return self.gc_seconds / self.seconds

    def at_time(self) -> str:
        """The epoch in Julia's ``@time`` style; allocations are the estimate (marked ``~``)."""
        from benchlib.units import format_bytes, format_count

        text = f"{self.seconds:10.6f} seconds ("
        if not math.isnan(self.alloc_count_est):
            text += (f"~{format_count(int(round(self.alloc_count_est)))} allocations: "
                     f"~{format_bytes(int(round(self.alloc_bytes_est)))}")
        if self.gc_seconds > 0:
            text += f", {100 * self.gc_share:.2f}% gc time"
        return text + ")"


def run_lenet(
    data,
    *,
    device,
    config: LeNetConfig = LeNetConfig(),
    modes=MODES,
    alloc_steps: int = 2,
    warmup_steps: int = 1,
    progress=None,
) -> tuple[list[EpochResult], dict]:
    """Train each mode for ``config.epochs`` epochs; returns the epochs and the labels to record.

    Each mode first takes ``warmup_steps`` untimed steps (one-time kernel and allocator set-up
    would otherwise land in the first timed epoch of whichever mode runs first); every mode takes
    the same ones, so the modes stay comparable.

    ``progress`` is called with (mode, EpochResult) after each epoch (the notebook prints the
    @time line there, as the MWE does).
    """
    from benchlib.measure import count_allocations, measure_steps

    unknown = [m for m in modes if m not in TRAINERS]
    if unknown:
        raise Refused(f"unknown LeNet modes {unknown}; valid: {', '.join(MODES)}")
    for name, value in (("alloc_steps", alloc_steps), ("warmup_steps", warmup_steps)):
        if not isinstance(value, int) or value < 0:
            raise Refused(f"{name} must be a non-negative integer, got {value!r}")
    x_all, y_all = data.as_float_tensors(device.torch)
    x_all = x_all.view(-1, 1, 28, 28)
    per_epoch = len(data) // config.batch
    steps = min(per_epoch, config.step_limit) if config.step_limit else per_epoch
    trained = per_epoch * config.epochs
    order = minibatch_indices(len(data), config.batch, trained + alloc_steps + warmup_steps, config.seed)
    order = order.to(device.torch)
    alloc_batches, warmup_batches = order[trained:trained + alloc_steps], order[trained + alloc_steps:]
    labels = asdict(config) | data.describe() | {"steps_per_epoch": steps, "steps_per_full_pass": per_epoch,
                                                "alloc_steps": alloc_steps,
                                                "warmup_steps": warmup_steps,
                                                "torch_threads": torch.get_num_threads(), "device": device.name,
                                                "params_per_model": sum(p.numel() for p in lenet5().parameters())}
    results = []
    for mode in modes:
        labels[f"loadavg_1m_before_{mode}"] = load_average()
        trainer = TRAINERS[mode](config, x_all, y_all, device.torch)
        if warmup_steps:
            trainer.run(warmup_batches)
        losses = {}
        timed = measure_steps(lambda epoch: trainer.run(order[epoch * per_epoch: epoch * per_epoch + steps]),
                              config.epochs, device=device, after_step=losses.__setitem__)
        epochs = [EpochResult(mode, epoch, timed.step_s[epoch], timed.gc_count[epoch], timed.gc_s[epoch],
                              losses[epoch], steps) for epoch in range(config.epochs)]
        if progress is not None and not alloc_steps:
            for result in epochs:
                progress(mode, result)
        if alloc_steps:
            allocs = count_allocations(lambda: (trainer.run(alloc_batches), device.synchronize()), device)
            labels["alloc_source"] = allocs.source
            for result in epochs:
                result.alloc_count_est = allocs.count / alloc_steps * result.steps
                result.alloc_bytes_est = allocs.bytes / alloc_steps * result.steps
                if allocs.python_count is not None:
                    result.alloc_count_python_est = allocs.python_count / alloc_steps * result.steps
                if progress is not None:
                    progress(mode, result)
        results += epochs
    return results, labels


def lenet_records(results: list[EpochResult], labels: dict, device) -> list[dict]:
    """Tidy rows, one per epoch and metric (``repeat`` is the epoch)."""
    rows = []
    for r in results:
        common = dict(benchmark=NAME, case=f"lenet5|{r.mode}", mode=r.mode, device=device,
                      dtype="float32", repeat=r.epoch, params=labels | {"mode": r.mode})
        for metric, value, unit in (("epoch_time", r.seconds, "s"), ("epoch_gc_time", r.gc_seconds, "s"),
                                    ("epoch_gc_pauses", r.gc_count, "count"),
                                    ("epoch_loss", r.loss, ""), ("epoch_alloc_count_est", r.alloc_count_est, "count"),
                                    ("epoch_alloc_bytes_est", r.alloc_bytes_est, "B"),
                                    ("epoch_alloc_count_python_est", r.alloc_count_python_est, "count")):
            rows.append(make_record(metric=metric, value=value, unit=unit, **common))
    return rows


def lenet_frame(results: list[EpochResult], labels: dict):
    """One row per mode and epoch, with the @time line, the data source, and what an "epoch" is
    here: `steps` minibatches of `batch` (`step_limit` may cut a full pass of `steps_per_full_pass`)."""
    import pandas as pd

    return pd.DataFrame([{"data": labels["data"], "mode": r.mode, "epoch": r.epoch, "steps": r.steps,
                          "batch": labels["batch"], "steps_per_full_pass": labels["steps_per_full_pass"],
                          "seconds": r.seconds,
                          "gc_share": r.gc_share, "gc_pauses": r.gc_count, "alloc_count_est": r.alloc_count_est,
                          "alloc_count_python_est": r.alloc_count_python_est,
                          "alloc_bytes_est": r.alloc_bytes_est, "loss": r.loss, "@time": r.at_time()}
                         for r in results])
