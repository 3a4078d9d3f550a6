"""benchlib.fit.cuda_policy: a step traced on the CPU runs what a named CUDA GPU would (autocast's casts, the
attention kernel), and leaves this process as it found it."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchlib.engines.techniques.builtin import _without_generation_cache
from benchlib.fit.cuda_policy import (CUDA_AUTOCAST, GPUS, AttentionCall, CudaPolicy, as_cuda, cpu_autocast_ops,
                                      cuda_autocast_ops, gpu_named, torch_named)
from benchlib.usermodel.shapes import materialized


class Ops(TorchDispatchMode):
    """The operators dispatched below autograd, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def autocast_dtypes() -> dict[str, torch.dtype]:
    """What a few ops return under autocast to bfloat16 on the CPU, from float32 inputs."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return {"linear": F.linear(x, w).dtype, "pow": torch.pow(x, 3.0).dtype,
                "layer_norm": F.layer_norm(x.bfloat16(), (8,)).dtype, "softmax": torch.softmax(x.bfloat16(), -1).dtype,
                "exp": x.bfloat16().exp().dtype, "stack": torch.stack([x, x]).dtype}


def test_every_op_cuda_autocast_handles_in_this_torch_has_a_known_policy():
    """The dispatcher says which ops CUDA's autocast touches; a new one in a later torch fails here by name."""
    handled = cuda_autocast_ops()
    assert {"mm", "linear", "pow.Tensor_Scalar", "layer_norm", "softmax.int", "scaled_dot_product_attention"} <= set(handled)
    assert [name for name, what in handled.items() if what is None] == []
    assert "stack" in cpu_autocast_ops() and "stack" not in handled  # the CPU's own list: left alone for CUDA
    assert set(CUDA_AUTOCAST.values()) == {"lower", "float32", "float32 output", "promote", "banned"}


def test_under_cuda_autocast_pow_layer_norm_and_softmax_run_in_float32_and_leave_no_trace_after():
    before = autocast_dtypes()
    assert before["pow"] == torch.float32 and before["linear"] == torch.bfloat16  # the CPU's: pow is not listed
    with FakeTensorMode(), as_cuda(GPUS["h100-80gb"]):
        inside = autocast_dtypes()
    assert inside == {"linear": torch.bfloat16, "pow": torch.float32, "layer_norm": torch.float32,
                      "softmax": torch.float32, "exp": torch.float32, "stack": torch.float32}
    assert autocast_dtypes() == before  # the registrations are gone


def test_the_casts_are_saved_for_backward_as_cuda_saves_them():
    """pow on a bfloat16 input under CUDA's autocast: the float32 copy is what the op saves (made above autograd)."""
    with FakeTensorMode(), as_cuda(GPUS["h200"]):
        x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.pow(x, 3.0)
        saved = [value for name in dir(y.grad_fn) if name.startswith("_saved_")
                 for value in [getattr(y.grad_fn, name)] if isinstance(value, torch.Tensor)]
        assert y.dtype == torch.float32 and [tensor.dtype for tensor in saved] == [torch.float32]


@pytest.mark.parametrize("gpu, dtype, heads, mask, expected", [
    ("h100-80gb", torch.float32, 8, False, "efficient"),  # cuDNN's takes half precision only
    ("h100-80gb", torch.bfloat16, 8, False, "cudnn"),  # first on compute capability 9.x since torch 2.11
    ("h100-80gb", torch.bfloat16, 8, True, "cudnn"),  # with a mask too
    ("h100-80gb", torch.bfloat16, 2, False, "cudnn"),  # and grouped-query heads as they are
    ("h100-80gb", torch.float32, 2, False, "math"),  # grouped heads in float32
    ("a100-40gb", torch.float16, 8, False, "flash"),
    ("a100-40gb", torch.bfloat16, 8, True, "efficient"),  # flash takes no mask
    ("a100-80gb", torch.bfloat16, 2, False, "flash"),  # grouped heads: keys and values repeated (the larger branch)
    ("l4", torch.bfloat16, 8, False, "flash"),  # cuDNN first only on 9.x and 10.x
    ("t4", torch.float16, 8, False, "efficient"),  # no flash before sm80
    ("t4", torch.bfloat16, 8, False, "math"),  # nor bfloat16 in the efficient one
])
def test_attention_runs_the_kernel_cuda_chooses_for_the_card(gpu, dtype, heads, mask, expected):
    with FakeTensorMode(), as_cuda(gpu_named(gpu), torch_named("2.13")) as policy:
        query = torch.randn(2, 8, 128, 64, dtype=dtype, requires_grad=True)
        key, value = (torch.randn(2, heads, 128, 64, dtype=dtype, requires_grad=True) for _ in range(2))
        bias = torch.ones(128, 128, dtype=torch.bool).tril() if mask else None
        with Ops() as ops:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, is_causal=not mask,
                                                 enable_gqa=heads != 8)
            out.sum().backward()
    fused = [name for name in ops.names if name.startswith("_scaled_dot_product")]
    if expected == "math":  # a composite of matrix products and a softmax: the whole attention matrix saved
        assert fused == [] and "_safe_softmax" in ops.names and "bmm" in ops.names
    else:
        assert set(fused) == {f"_scaled_dot_product_{expected}_attention",
                              f"_scaled_dot_product_{expected}_attention_backward"}
    assert out.shape == query.shape and query.grad.shape == query.shape
    assert policy.attention == {expected}


@pytest.mark.parametrize("release, dropout, deprioritized, expected", [
    ("2.13", 0.0, False, "cudnn"),
    ("2.13", 0.0, True, "flash"),  # TORCH_CUDNN_SDPA_DEPRIORITIZED keeps cuDNN last, as torch does
    ("2.13", 0.1, False, "flash"),  # cuDNN takes a dropout in sixteenths only, since 2.12
    ("2.13", 0.125, False, "cudnn"),
    ("2.11", 0.1, False, "cudnn"),
])
def test_each_release_orders_and_checks_the_kernels_as_its_cuda_build_does(monkeypatch, release, dropout,
                                                                           deprioritized, expected):
    if deprioritized:
        monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    policy = CudaPolicy(GPUS["h200"], torch_named(release))
    with FakeTensorMode():
        query = torch.randn(2, 8, 128, 64, dtype=torch.bfloat16)
        assert policy.attention_kernel(AttentionCall(query, query, query, dropout_p=dropout)) == expected
        assert policy.attention_kernel(AttentionCall(query[0], query[0], query[0])) == "math"  # 3-D: no fused kernel


@pytest.mark.parametrize("gpu, shape, causal, grad, expected", [
    ("a100-80gb", (2, 8, 128, 64), True, True, "flash"),
    ("a100-80gb", (2, 8, 128, 64, 256), True, True, "efficient"),  # causal over more keys than queries: not flash
    ("l4", (2, 8, 128, 200), False, True, "efficient"),  # sm89: no flash for heads of 193-224 in training
    ("l4", (2, 8, 128, 200), False, False, "flash"),
    ("a100-80gb", (2, 8, 128, 200), False, True, "flash"),
])
def test_flash_is_chosen_as_its_checks_allow(gpu, shape, causal, grad, expected):
    batch, heads, queries, head, *keys = shape
    policy = CudaPolicy(gpu_named(gpu), torch_named("2.13"))
    with FakeTensorMode():
        query = torch.randn(batch, heads, queries, head, dtype=torch.float16, requires_grad=grad)
        key = torch.randn(batch, heads, keys[0] if keys else queries, head, dtype=torch.float16)
        assert policy.attention_kernel(AttentionCall(query, key, key, is_causal=causal)) == expected


def test_a_release_benchlib_does_not_know_is_refused_and_the_installed_one_is_the_default():
    with pytest.raises(ValueError, match=r"--torch '2.9' is not a release .* known: 2.11, 2.12, 2.13"):
        torch_named("2.9")
    assert torch_named("torch 2.11.0+cu130").version == "2.11" and torch_named(" 2.12 ").version == "2.12"
    assert torch_named(None).version == ".".join(torch.__version__.split("+")[0].split(".")[:2])


def test_the_cpu_kernel_runs_again_once_the_policy_is_left():
    with FakeTensorMode():
        with as_cuda(GPUS["h200"]):
            pass
        q = torch.randn(1, 2, 16, 8, requires_grad=True)
        with Ops() as ops:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names


def test_a_gpu_benchlib_does_not_know_is_refused_with_the_closest_names():
    with pytest.raises(ValueError, match=r"'h100' is not a GPU benchlib knows \(did you mean .*h100-80gb.*known: h200"):
        gpu_named("h100")
    assert gpu_named(" H200 ").capability == (9, 0) and GPUS["h200"].memory_bytes == 143771 << 20


def test_a_model_materialized_from_the_meta_device_keeps_its_tied_weights():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = materialized(Tied)
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1


def test_checkpointing_turns_a_transformers_generation_cache_off_as_transformers_does():
    class Config:
        use_cache = True

    model = torch.nn.Linear(2, 2)
    model.config = Config()
    _without_generation_cache(model)
    assert model.config.use_cache is False
    _without_generation_cache(torch.nn.Linear(2, 2))  # no config: nothing to do
