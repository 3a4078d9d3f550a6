"""What a CUDA GPU runs where a trace on the CPU would run the CPU's choice: the layer `predicted` puts under a
step traced for a GPU it does not have (`as_cuda(gpu)`).

Two choices differ, and both change what the step saves for backward:

- **Autocast.** CUDA's autocast policy is not the CPU's: `exp`, `pow`, `softmax`, `layer_norm`, the losses and more
  run in float32 on CUDA (their outputs float32), and the CPU lists ops CUDA leaves alone. Which ops CUDA's autocast
  touches is read from the installed torch's dispatcher (the ops with an `AutocastCUDA` kernel); what each does
  with its inputs is `CUDA_AUTOCAST` (torch's `autocast_mode.cpp`). For the trace, every op of either list gets an
  `AutocastCPU` kernel that casts as CUDA's would, above autograd, so the casts are saved as CUDA saves them.
- **Attention.** `scaled_dot_product_attention` picks a kernel by the GPU's compute capability, the dtype, the
  mask, the head size and grouped-query heads (`select_sdp_backend` in torch's `sdp_utils.cpp`), in the order the
  installed torch sets (`torch._C._get_sdp_priority_order`), among the kernels its flags enable. The trace calls
  the chosen CUDA operator (`_scaled_dot_product_{flash,efficient}_attention` or the math path), whose meta
  kernels save, under fake tensors, what the CUDA kernels save.

Which kernel a release picks is not all in the installed CPU build: the order it takes on a GPU (cuDNN first on
compute capability 9.x and 10.x since torch 2.11) and its checks that differ by release are `TORCH_RULES`, read
from each release's CUDA wheel; `--torch` names the release emulated (default: the installed one's).

Where a choice cannot be known, the larger branch is taken and said (`CudaPolicy.assumed`): an op with an
`AutocastCUDA` kernel this table does not know runs in float32; grouped-query heads on the flash kernel are
repeated to full heads; the math path upcasts half precision to float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from benchlib.errors import Refused

# CUDA's autocast, by op (every overload) or by "op.overload": what it does with floating-point inputs.
LOWER = "lower"  # cast to the autocast dtype (bfloat16 or float16)
FLOAT32 = "float32"  # cast to float32
FLOAT32_OUTPUT = "float32 output"  # reduced inputs kept, the output asked in float32 (the op's `dtype` argument)
PROMOTE = "promote"  # cast to the widest floating dtype among the inputs
BANNED = "banned"  # refused under autocast (CUDA raises)
CUDA_AUTOCAST: dict[str, str] = {
    **dict.fromkeys((
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm",
        "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
        "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
        "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    ), LOWER),
    **dict.fromkeys((
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
        "frobenius_norm", "nuclear_norm", "norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
        "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
        "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ), FLOAT32),
    **dict.fromkeys((
        "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
    ), FLOAT32_OUTPUT),
    **dict.fromkeys((
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
        "scatter_add",
    ), PROMOTE),
    "binary_cross_entropy": BANNED,
}


@dataclass(frozen=True)
class Gpu:
    """A GPU a step is predicted for: what its kernels' choices depend on (the compute capability) and its memory
    as the driver reports it (what `--memory` defaults to)."""

    name: str
    capability: tuple[int, int]
    memory_mib: int

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20


# The cards by the names `--gpu` takes; memory as nvidia-smi reports each (the H200's as a run of this project's on
# one recorded it: results/reference/).
GPUS: dict[str, Gpu] = {
    "h200": Gpu("NVIDIA H200", (9, 0), 143771),
    "h100-80gb": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 81559),
    "a100-80gb": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 81920),
    "a100-40gb": Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 40960),
    "l4": Gpu("NVIDIA L4", (8, 9), 23034),
    "rtx-4090": Gpu("NVIDIA GeForce RTX 4090", (8, 9), 24564),
    "t4": Gpu("Tesla T4", (7, 5), 15360),
    "v100-32gb": Gpu("Tesla V100-SXM2-32GB", (7, 0), 32768),
}
DEFAULT_GPU = "h100-80gb"


@dataclass(frozen=True)
class TorchRules:
    """What one torch release's CUDA build decides about attention where the installed CPU build cannot tell: read
    from that release's CUDA wheel on PyPI (its shipped headers and its compiled `select_sdp_backend`). All three
    known releases order flash, efficient, math, cuDNN, and move cuDNN first on the first attention call on a GPU of
    compute capability 9.x or 10.x (unless `TORCH_CUDNN_SDPA_DEPRIORITIZED` is set), since the cuDNN they bundle is
    newer than 9.15."""

    version: str
    cudnn_first_minors: tuple[int, ...] | None  # on 9.x/10.x, only these minor versions move cuDNN first (None: any)
    cudnn_dropout_sixteenths: bool  # cuDNN takes only a dropout that is a multiple of 1/16
    cudnn_max_batch_heads: int | None  # cuDNN takes no batch or head count above this
    efficient_aligned_offset: bool  # efficient attention (8.0 and later) takes no q/k/v at an unaligned storage offset

    def cudnn_first(self, gpu: Gpu) -> bool:
        import os

        major, minor = gpu.capability
        return (major in (9, 10) and (self.cudnn_first_minors is None or minor in self.cudnn_first_minors)
                and not os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"))


TORCH_RULES: dict[str, TorchRules] = {
    "2.11": TorchRules("2.11", (0, 3), False, None, False),  # bundles cuDNN 9.19
    "2.12": TorchRules("2.12", (0, 3), True, None, False),  # cuDNN 9.20
    "2.13": TorchRules("2.13", None, True, 65535, True),  # cuDNN 9.20
}


def installed_torch() -> str:
    """The installed torch's release, as "2.13"."""
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def torch_named(version: str | None) -> TorchRules:
    """The rules of the release `--torch VERSION` names (None: the installed one's, or the newest known where the
    installed one is not in the table); a refusal listing the known releases otherwise."""
    if version is None:
        installed = installed_torch()
        return TORCH_RULES.get(installed) or TORCH_RULES[max(TORCH_RULES, key=lambda v: tuple(map(int, v.split("."))))]
    key = ".".join(str(version).strip().removeprefix("torch").strip().split("+")[0].split(".")[:2])
    if key not in TORCH_RULES:
        raise Refused(f"--torch {version!r} is not a release whose kernel choices benchlib knows; known: "
                      f"{', '.join(TORCH_RULES)}")
    return TORCH_RULES[key]


def gpu_named(name: str) -> Gpu:
    """The card `--gpu NAME` names; a clear refusal listing the known names otherwise."""
    key = name.strip().lower()
    if key not in GPUS:
        import difflib

        close = difflib.get_close_matches(key, GPUS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise Refused(f"--gpu {name!r} is not a GPU benchlib knows{hint}; known: {', '.join(GPUS)}")
    return GPUS[key]


def cuda_autocast_ops() -> dict[str, str]:
    """Every "op.overload" the installed torch's CUDA autocast handles (an `AutocastCUDA` kernel), with what it does
    (`CUDA_AUTOCAST`; an op the table does not know: FLOAT32, the larger branch)."""
    import torch

    handled = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(qualified,
                                                                                             "AutocastCUDA"):
            name = qualified[len("aten::"):]
            handled[name] = CUDA_AUTOCAST.get(name, CUDA_AUTOCAST.get(name.split(".")[0]))
    return handled


def cpu_autocast_ops() -> set[str]:
    """Every "op.overload" the installed torch's CPU autocast handles: in a trace for CUDA, those CUDA's does not
    are left alone."""
    import torch

    return {qualified[len("aten::"):] for qualified in torch._C._dispatch_get_all_op_names()
            if qualified.startswith("aten::")
            and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCPU")}


@dataclass(frozen=True)
class AttentionCall:
    """One `scaled_dot_product_attention` call, as CUDA's `select_sdp_backend` reads it."""

    query: Any
    key: Any
    value: Any
    attn_mask: Any = None
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False

    @property
    def half(self) -> bool:
        import torch

        return self.query.dtype in (torch.float16, torch.bfloat16)

    @property
    def grouped(self) -> bool:
        """Keys and values with fewer heads than the query (or than each other)."""
        return self.query.size(-3) != self.key.size(-3) or self.key.size(-3) != self.value.size(-3)

    def fused(self) -> bool:
        """Whether any fused kernel may take it: 4-D inputs, and grouped-query heads only where asked for
        (`enable_gqa`; flash's and cuDNN's take them, efficient's not before torch 2.14)."""
        return self.query.dim() == 4 and (not self.grouped or self.enable_gqa)


@dataclass
class CudaPolicy:
    """The choices a trace made as `gpu` would (`as_cuda`): the attention kernels it ran, and where it took the
    larger branch because the choice could not be known."""

    gpu: Gpu
    rules: TorchRules = field(default_factory=lambda: torch_named(None))
    attention: set[str] = field(default_factory=set)
    assumed: set[str] = field(default_factory=set)

    def attention_kernel(self, call: AttentionCall) -> str:
        """The kernel CUDA's `select_sdp_backend` picks on this GPU, in the order the release sets (cuDNN first where
        `TorchRules.cudnn_first`), among the kernels the installed torch's flags enable."""
        import torch

        order = {1: "flash", 2: "efficient", 0: "math", 3: "cudnn", 4: "overrideable"}
        kernels = [order.get(int(choice)) for choice in torch._C._get_sdp_priority_order()]
        if self.rules.cudnn_first(self.gpu):
            kernels = ["cudnn", *(kernel for kernel in kernels if kernel != "cudnn")]
        enabled = {"flash": torch._C._get_flash_sdp_enabled(), "efficient": torch._C._get_mem_efficient_sdp_enabled(),
                   "math": torch._C._get_math_sdp_enabled(), "cudnn": torch._C._get_cudnn_sdp_enabled()}
        takes = {"flash": self._flash_takes, "efficient": self._efficient_takes, "cudnn": self._cudnn_takes}
        for kernel in kernels:
            if kernel == "math" and enabled["math"]:
                return "math"
            if enabled.get(kernel) and kernel in takes and call.fused() and takes[kernel](call):
                return kernel
        return "math"

    def _flash_takes(self, call: AttentionCall) -> bool:
        query, key, value = call.query, call.key, call.value
        head, capability = query.size(-1), self.gpu.capability
        training = any(tensor.requires_grad for tensor in (query, key, value))
        sm86_89 = capability in ((8, 6), (8, 9))  # its kernels' shared memory: no large heads in training
        return (capability >= (8, 0) and call.half and call.attn_mask is None and key.size(-1) == head
                and value.size(-1) == head and head <= 256
                and not (call.is_causal and query.size(-2) != key.size(-2))
                and not (sm86_89 and training and (192 < head <= 224 or head > 224 and call.dropout_p)))

    def _efficient_takes(self, call: AttentionCall) -> bool:
        import torch

        query, key, value, capability = call.query, call.key, call.value, self.gpu.capability
        if call.grouped:
            return False
        dtype_ok = query.dtype in (torch.float32, torch.float16) or (
            query.dtype == torch.bfloat16 and capability >= (8, 0))
        align = 8 if call.half else (4 if capability >= (8, 0) else 1)
        offsets = not self.rules.efficient_aligned_offset or capability < (8, 0) or all(
            tensor.storage_offset() % align == 0 for tensor in (query, key, value))
        return (capability >= (5, 0) and dtype_ok and key.size(-1) == query.size(-1)
                and query.size(-1) % align == 0 and value.size(-1) % align == 0 and offsets)

    def _cudnn_takes(self, call: AttentionCall) -> bool:
        query, key, value, mask = call.query, call.key, call.value, call.attn_mask
        limit = self.rules.cudnn_max_batch_heads
        heads = (query.size(-1), value.size(-1))
        return (self.gpu.capability >= (8, 0) and call.half and max(heads) <= 256 and heads[0] % 8 == 0
                and heads[1] % 8 == 0 and key.size(-2) != 1 and not (call.dropout_p and query.size(-2) == 1)
                and not (self.rules.cudnn_dropout_sixteenths and (call.dropout_p * 16) % 1)
                and (limit is None or max(query.size(0), query.size(1)) <= limit)
                and (mask is None or 2 <= mask.dim() <= 4 and not mask.requires_grad))

    def attention_output(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
        """`scaled_dot_product_attention` as CUDA runs it: the chosen kernel's operator, above autograd."""
        import torch

        aten = torch.ops.aten
        kernel = self.attention_kernel(AttentionCall(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa))
        self.attention.add(kernel)
        if kernel in ("efficient", "cudnn") and attn_mask is not None and attn_mask.dtype == torch.bool:
            # CUDA turns a boolean mask into an additive bias of the query's dtype
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        wants_lse = any(t.requires_grad for t in (query, key, value))
        if kernel == "flash":
            if query.size(-3) != key.size(-3):
                self.assumed.add("grouped-query heads on the flash kernel: keys and values repeated to every head")
                groups = query.size(-3) // key.size(-3)
                key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        if kernel == "cudnn":
            return aten._scaled_dot_product_cudnn_attention(query, key, value, attn_mask, wants_lse, dropout_p,
                                                            is_causal, False, scale=scale)[0]
        if kernel == "efficient":
            if attn_mask is not None and attn_mask.size(-1) % 16:  # the kernel reads a bias padded to 16 columns
                pad = 16 - attn_mask.size(-1) % 16
                attn_mask = torch.nn.functional.pad(attn_mask, (0, pad))[..., :attn_mask.size(-1)]
            return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, wants_lse, dropout_p,
                                                                is_causal, scale=scale)[0]
        dtype = query.dtype
        if dtype in (torch.float16, torch.bfloat16) and not torch._C._get_math_sdp_allow_fp16_bf16_reduction():
            self.assumed.add("the math attention path in half precision: computed in float32, as CUDA's upcasts")
            query, key, value = query.float(), key.float(), value.float()
        out = aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                      scale=scale, enable_gqa=enable_gqa)[0]
        return out.to(dtype)


def _autocast_kernel(op, what: str | None):
    """An `AutocastCPU` kernel doing what CUDA's autocast does for `op` (what: a CUDA_AUTOCAST value; None: what
    CUDA's leaves alone), then the op below autocast."""
    import torch

    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    takes_dtype = "dtype" in [argument.name for argument in op._schema.arguments]
    name = op.name()

    def eligible(value) -> bool:
        return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64

    def cast(values, dtype):
        return [value.to(dtype) if eligible(value) and value.dtype != dtype else
                [cast([item], dtype)[0] for item in value] if isinstance(value, (list, tuple)) else value
                for value in values]

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below):
            if what == BANNED:
                raise RuntimeError(f"{name} is unsafe to autocast on CUDA (torch refuses it there)")
            if what == LOWER:
                args = cast(args, torch.get_autocast_dtype("cpu"))
            elif what == FLOAT32:
                args = cast(args, torch.float32)
            elif what == FLOAT32_OUTPUT:
                reduced = any(eligible(value) and value.dtype != torch.float32 for value in args)
                if reduced and takes_dtype and kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                elif reduced:
                    args = cast(args, torch.float32)
            elif what == PROMOTE:
                dtypes = [value.dtype for value in args if eligible(value)]
                if dtypes:
                    widest = max(dtypes, key=lambda dtype: torch.finfo(dtype).bits)
                    args = cast(args, widest)
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def as_cuda(gpu: Gpu, rules: TorchRules | None = None) -> Iterator[CudaPolicy]:
    """Within it, this process's operators choose as `gpu` would under the release `rules` describes (default: the
    installed one's): autocast on the CPU casts as CUDA's does (the installed torch's lists), and attention runs the
    kernel CUDA would choose (on fake tensors: real CPU tensors have no CUDA kernel to run). The registrations are
    removed on exit."""
    import warnings

    import torch

    policy = CudaPolicy(gpu, rules or torch_named(None))
    library = torch.library.Library("aten", "IMPL")
    cuda_ops = cuda_autocast_ops()
    unknown = sorted(name for name, what in cuda_ops.items() if what is None)
    if unknown:
        policy.assumed.add(f"ops CUDA's autocast handles that benchlib's table does not, run in float32: "
                           f"{', '.join(unknown)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's, about overriding the CPU's own autocast kernels: the point
        for name in sorted(set(cuda_ops) | cpu_autocast_ops()):
            packet_name, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")
            what = (cuda_ops[name] or FLOAT32) if name in cuda_ops else None  # the CPU's own: left alone
            library.impl(name, _autocast_kernel(op, what), "AutocastCPU")
        library.impl("scaled_dot_product_attention", policy.attention_output, "AutogradCPU")
    try:
        yield policy
    finally:
        library._destroy()


def emulated(gpu: str, torch_version: str | None = None) -> str:
    """What a prediction for the card `gpu` under the release `torch_version` (None: the installed one's) emulates,
    in words for its answer."""
    card, rules = gpu_named(gpu), torch_named(torch_version)
    major, minor = card.capability
    lists = "" if rules.version == installed_torch() else f", with autocast's lists of the installed {installed_torch()}"
    return (f"{card.name} (compute capability {major}.{minor}, {card.memory_mib} MiB; --gpu to choose), "
            f"as torch {rules.version} chooses its kernels{lists} (--torch to choose)")
