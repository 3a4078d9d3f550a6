"""Six ways to train the ensemble, each starting from the same stacked parameters."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from benchlib.errors import Refused
from benchlib.workloads.ensembles.config import STRATEGIES, PARAM_NAMES, EnsembleConfig


def _make_net(config: EnsembleConfig, device=None) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(config.inputs, config.hidden), nn.ReLU(), nn.Linear(config.hidden, config.classes)
    ).to(device)


def _adam_kind(device: torch.device) -> dict:
    """Fused Adam where this torch supports it on ``device``, else the foreach implementation."""
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        torch.optim.Adam([probe], fused=True)
        return {"fused": True}
    except (RuntimeError, ValueError):
        return {"foreach": True}


def _per_net_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(n_nets, batch, classes) logits -> each net's mean cross-entropy, shape (n_nets,)."""
    n, b, c = logits.shape
    return F.cross_entropy(logits.reshape(n * b, c), y.repeat(n), reduction="none").view(n, b).mean(1)


class Strategy:
    """One way to train the ensemble; ``step(x, y)`` trains every net on the shared minibatch
    and returns the per-net losses (detached; valid until the next step, which may reuse them)."""

    name = ""
    optimizer = ""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def stacked_parameters(self) -> dict[str, torch.Tensor]:
        """Every net's parameters, stacked per layer (detached copies on the CPU)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release hooks; the default has none."""


class _PerNetStrategy(Strategy):
    def __init__(self, init: dict[str, torch.Tensor], config: EnsembleConfig, device: torch.device):
        self.config = config
        self.nets = []
        for index in range(config.n_nets):
            net = _make_net(config, device)
            with torch.no_grad():
                for name, param in net.named_parameters():
                    param.copy_(init[name][index])
            self.nets.append(net)

    def stacked_parameters(self):
        per_net = [dict(net.named_parameters()) for net in self.nets]
        return {name: torch.stack([p[name].detach().cpu() for p in per_net]) for name in PARAM_NAMES}

    def gradients(self, x, y) -> dict[str, torch.Tensor]:
        """Stacked gradients of each net's mean loss on (x, y), without an optimiser step."""
        grads = {name: [] for name in PARAM_NAMES}
        for net in self.nets:
            loss = F.cross_entropy(net(x), y)
            names, params = zip(*net.named_parameters())
            for name, g in zip(names, torch.autograd.grad(loss, params)):
                grads[name].append(g.cpu())
        return {name: torch.stack(gs) for name, gs in grads.items()}


class Naive(_PerNetStrategy):
    """One module and one for-loop Adam per net; ``zero_grad(set_to_none=True)`` recreates every
    gradient each step: the textbook loop, run 200 times."""

    name = "naive"
    optimizer = "Adam(foreach=False) per net"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        self.opts = [torch.optim.Adam(net.parameters(), lr=config.lr, foreach=False) for net in self.nets]

    def step(self, x, y):
        losses = []
        for net, opt in zip(self.nets, self.opts):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)


class BuffersReused(_PerNetStrategy):
    """Per-net modules, but gradients zeroed in place (allocated once) and fused Adam; losses
    written into one preallocated tensor."""

    name = "buffers_reused"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        kind = _adam_kind(device)
        self.optimizer = f"Adam({next(iter(kind))}=True) per net"
        self.opts = [torch.optim.Adam(net.parameters(), lr=config.lr, **kind) for net in self.nets]
        self.losses = torch.zeros(config.n_nets, device=device)

    def step(self, x, y):
        for index, (net, opt) in enumerate(zip(self.nets, self.opts)):
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            self.losses[index] = loss.detach()
        return self.losses.clone()


class StepInBackward(_PerNetStrategy):
    """Each parameter has its own Adam, stepped by a post-accumulate-grad hook the moment its
    gradient is ready; the gradient is then dropped, so no step ever holds all gradients."""

    name = "step_in_backward"
    optimizer = "Adam(foreach=False) per parameter, in a post-accumulate-grad hook"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        self.handles = []
        for net in self.nets:
            for param in net.parameters():
                opt = torch.optim.Adam([param], lr=config.lr, foreach=False)
                self.handles.append(param.register_post_accumulate_grad_hook(self._stepper(opt)))

    @staticmethod
    def _stepper(opt):
        def hook(_param):
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hook

    def step(self, x, y):
        losses = []
        for net in self.nets:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    def close(self):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class _StackedStrategy(Strategy):
    def __init__(self, init, config, device):
        self.config = config
        kind = _adam_kind(device)
        self.optimizer = f"Adam({next(iter(kind))}=True) over stacked parameters"
        self.params = {name: init[name].to(device).clone().requires_grad_(True) for name in PARAM_NAMES}
        self.opt = torch.optim.Adam(self.params.values(), lr=config.lr, **kind)

    def logits(self, x) -> torch.Tensor:
        raise NotImplementedError

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=False)
        losses = _per_net_losses(self.logits(x), y)
        losses.sum().backward()  # each net's gradient is that of its own mean loss
        self.opt.step()
        return losses.detach()

    def stacked_parameters(self):
        return {name: p.detach().cpu().clone() for name, p in self.params.items()}

    def gradients(self, x, y):
        loss = _per_net_losses(self.logits(x), y).sum()
        grads = torch.autograd.grad(loss, list(self.params.values()))
        return {name: g.cpu() for name, g in zip(self.params, grads)}


class BatchedVmap(_StackedStrategy):
    """``torch.func``: ``stack_module_state`` layout, ``vmap`` over ``functional_call`` of one
    stateless copy of the net (on the meta device)."""

    name = "batched_vmap"

    def __init__(self, init, config, device):
        super().__init__(init, config, device)
        base = _make_net(config, "meta")

        def one_net(params, x):
            return torch.func.functional_call(base, params, (x,))

        self._forward = torch.func.vmap(one_net, in_dims=(0, None))

    def logits(self, x):
        return self._forward(self.params, x)


class BatchedHand(_StackedStrategy):
    """Hand-batched: the shared minibatch meets all first layers in one ``addmm`` against the
    (n_nets*hidden, inputs) weight block; the second layers are one ``baddbmm``."""

    name = "batched_hand"

    def logits(self, x):
        n, h = self.config.n_nets, self.config.hidden
        w1, b1, w2, b2 = (self.params[name] for name in PARAM_NAMES)
        hidden = torch.addmm(b1.reshape(n * h), x, w1.reshape(n * h, -1).t()).relu_()  # (B, n*h)
        hidden = hidden.view(x.shape[0], n, h).transpose(0, 1)  # (n, B, h)
        return torch.baddbmm(b2.unsqueeze(1), hidden, w2.transpose(1, 2))  # (n, B, classes)


class BatchedFused(Strategy):
    """No autograd: the forward and the hand-written backward of all nets in a fixed set of
    matmuls writing into buffers made once, over one flat parameter tensor that one Adam kernel steps.

    Layout (feature-major, so every product is a plain BLAS call and softmax runs over a strided
    dim of 10 rather than a contiguous one, which torch's CPU kernel does 20x slower): hidden
    ``H = relu(W1 @ x.T + b1)`` is (n*hidden, batch), one ``addmm``; logits ``W2 @ H`` are
    (n, classes, batch), one ``baddbmm``. One softmax serves the loss (minus the log of the target's
    probability) and the gradient of each net's own mean loss, ``dlogits = (softmax - onehot) / batch``;
    then ``dW2 = dlogits @ H.T``, ``dH = W2.T @ dlogits`` masked where relu was 0, ``dW1 = dH @ x``
    (the input needs none).

    Adam is ``torch._fused_adam_``, the kernel ``Adam(fused=True)`` runs, called directly: the
    optimiser's own Python around it (grouping, checks: ~50 mallocs and ~190 Python objects a step)
    took 0.06-0.16 ms of a ~2 ms step on the 2-core CPU. So a warm step allocates no tensor and leaves no Python
    object behind: neither the allocator nor the collector has anything to do in it. ``step``
    returns its loss buffer, which the next step overwrites."""

    name = "batched_fused"
    optimizer = "Adam over one flat parameter (torch._fused_adam_, the kernel of Adam(fused=True))"

    def __init__(self, init, config, device):
        self.config, self.device = config, device
        self.sizes = [init[name].numel() for name in PARAM_NAMES]
        self.flat = torch.cat([init[name].reshape(-1) for name in PARAM_NAMES]).to(device)
        self.w1, self.b1, self.w2, self.b2 = self._views(self.flat)
        self.w2_t = self.w2.transpose(1, 2)
        self.grad = None

    def _views(self, flat):
        """W1 (n*hidden, inputs), b1 (n*hidden, 1), W2 (n, classes, hidden), b2 (n, classes, 1) of a flat tensor."""
        n, h, c = self.config.n_nets, self.config.hidden, self.config.classes
        shapes = ((n * h, self.config.inputs), (n * h, 1), (n, c, h), (n, c, 1))
        return tuple(part.view(shape) for part, shape in zip(flat.split(self.sizes), shapes))

    def _allocate(self) -> None:
        """Gradients, Adam's state and every buffer of the step, made in the first step, where the
        other strategies make their gradients and Adam state, so the cell's peak memory counts them."""
        n, h, c, b = self.config.n_nets, self.config.hidden, self.config.classes, self.config.batch
        empty = lambda *shape, **kw: torch.empty(shape, device=self.device, **kw)  # noqa: E731
        self.grad = torch.zeros_like(self.flat)
        self.gw1, self.gb1, self.gw2, self.gb2 = self._views(self.grad)
        exp_avg, exp_avg_sq = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        self.adam_step = torch.zeros((), device=self.device)
        self.adam_state = ([self.flat], [self.grad], [exp_avg], [exp_avg_sq], [], [self.adam_step])
        self.hidden, self.d_hidden = empty(n * h, b), empty(n * h, b)
        self.hidden_3d, self.d_hidden_3d = self.hidden.view(n, h, b), self.d_hidden.view(n, h, b)
        self.hidden_3d_t = self.hidden_3d.transpose(1, 2)
        self.logits, self.d_logits, self.minus_onehot = empty(n, c, b), empty(n, c, b), empty(c, b)
        self.picked, self.losses = empty(n, 1, b), empty(n)

    def _forward_backward(self, x, y) -> None:
        """Losses into ``self.losses``, gradients into ``self.grad``, for one batch of size ``config.batch``."""
        if self.grad is None:
            self._allocate()
        torch.addmm(self.b1, self.w1, x.t(), out=self.hidden).relu_()
        torch.baddbmm(self.b2, self.w2, self.hidden_3d, out=self.logits)
        probabilities, batch = torch.softmax(self.logits, 1, out=self.d_logits), self.config.batch
        torch.gather(probabilities, 1, y.view(1, 1, -1).expand(self.config.n_nets, 1, -1), out=self.picked).log_()
        torch.sum(self.picked, (1, 2), out=self.losses).div_(-batch)
        self.minus_onehot.zero_().scatter_(0, y.view(1, -1), -1.0 / batch)  # -1/batch at each class
        torch.add(self.minus_onehot, probabilities, alpha=1.0 / batch, out=self.d_logits)  # (softmax - onehot) / batch
        torch.sum(self.d_logits, 2, keepdim=True, out=self.gb2)
        torch.bmm(self.d_logits, self.hidden_3d_t, out=self.gw2)
        torch.bmm(self.w2_t, self.d_logits, out=self.d_hidden_3d)
        torch.ops.aten.threshold_backward.grad_input(self.d_hidden, self.hidden, 0, grad_input=self.d_hidden)
        torch.mm(self.d_hidden, x, out=self.gw1)
        torch.sum(self.d_hidden, 1, keepdim=True, out=self.gb1)

    def step(self, x, y):
        self._forward_backward(x, y)
        self.adam_step.add_(1)  # as Adam(fused=True): the kernel reads the step already counted
        torch._fused_adam_(*self.adam_state, lr=self.config.lr, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                           amsgrad=False, maximize=False)
        return self.losses

    def stacked_parameters(self):
        n, h, c = self.config.n_nets, self.config.hidden, self.config.classes
        shapes = {"0.weight": (n, h, -1), "0.bias": (n, h), "2.weight": (n, c, h), "2.bias": (n, c)}
        parts = dict(zip(PARAM_NAMES, (self.w1, self.b1, self.w2, self.b2)))
        return {name: parts[name].reshape(shapes[name]).cpu().clone() for name in PARAM_NAMES}

    def gradients(self, x, y):
        """Stacked gradients of each net's mean loss on (x, y), without an optimiser step."""
        self._forward_backward(x, y)
        n, h, c = self.config.n_nets, self.config.hidden, self.config.classes
        grads = (self.gw1.view(n, h, -1), self.gb1.view(n, h), self.gw2, self.gb2.view(n, c))
        return {name: g.cpu().clone() for name, g in zip(PARAM_NAMES, grads)}


def evaluate(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each net's mean cross-entropy on (x, y) from stacked parameters (`stacked_parameters()`)."""
    w1, b1, w2, b2 = (params[name] for name in PARAM_NAMES)
    with torch.no_grad():
        hidden = torch.einsum("bi,nhi->nbh", x, w1).add_(b1.unsqueeze(1)).relu_()
        return _per_net_losses(torch.baddbmm(b2.unsqueeze(1), hidden, w2.transpose(1, 2)), y)


STRATEGY_CLASSES = {cls.name: cls for cls in (Naive, BuffersReused, StepInBackward, BatchedVmap, BatchedHand,
                                             BatchedFused)}


def make_strategy(name: str, init: dict[str, torch.Tensor], config: EnsembleConfig, device) -> Strategy:
    """A strategy by name, its nets set to ``init`` (stacked, from `initial_parameters`)."""
    if name not in STRATEGY_CLASSES:
        raise Refused(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")
    return STRATEGY_CLASSES[name](init, config, getattr(device, "torch", device))
