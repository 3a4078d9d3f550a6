"""benchlib.autodiff: gradients, accumulation strategies, memory counters, dtype rules, hooks, errors."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from benchlib.autodiff import ACCUMULATE_MODES, Primitive, grad, ops, value_and_grad

# ---------------------------------------------------------------------------------------------
# Randomly generated programs: one description, replayed on NumPy, on torch, traced or not.
# ---------------------------------------------------------------------------------------------

UNARY = ("tanh", "exp", "log1sq", "relu", "neg", "pow", "rpow", "scale", "shift", "reshape", "transpose", "sum", "mean")
BINARY = ("add", "sub", "mul", "div", "maximum", "matmul", "dot", "mse", "pow_traced")


def _apply(op, args, params):
    """One instruction of a generated program, written only with ops and operators."""
    a = args[0]
    b = args[1] if len(args) > 1 else None
    if op == "tanh":
        return ops.tanh(a)
    if op == "exp":
        return ops.exp(a)
    if op == "log1sq":
        return ops.log(a * a + 1.0)
    if op == "relu":
        return ops.relu(a)
    if op == "neg":
        return -a
    if op == "pow":
        return (a * a + 0.5) ** params["exponent"]
    if op == "rpow":
        return params["base"] ** a
    if op == "scale":
        return params["c"] * a
    if op == "shift":
        return a - params["c"] if params["left"] else params["c"] - a
    if op == "reshape":
        return ops.reshape(a, params["shape"])
    if op == "transpose":
        return ops.transpose(a, params["axes"])
    if op == "sum":
        return ops.sum(a, axis=params["axis"], keepdims=params["keepdims"])
    if op == "mean":
        return ops.mean(a, axis=params["axis"], keepdims=params["keepdims"])
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        return a / (b * b + 1.0)
    if op == "maximum":
        return ops.maximum(a, b)
    if op == "matmul":
        return a @ b
    if op == "dot":
        return ops.dot(a, b)
    if op == "mse":
        return ops.mse(a, b)
    if op == "pow_traced":
        return (a * a + 0.5) ** ops.tanh(b)
    raise AssertionError(op)


def _random_params(rng, op, shape):
    ndim = len(shape)
    if op == "pow":
        return {"exponent": float(rng.choice([2, 3, 1.5, -0.5]))}
    if op == "rpow":
        return {"base": float(rng.uniform(0.5, 2.5))}
    if op in ("scale", "shift"):
        return {"c": float(rng.uniform(-2, 2)), "left": bool(rng.integers(2))}
    if op == "reshape":
        size = int(np.prod(shape))
        choices = [(size,), (1, size), tuple(reversed(shape))]
        if size % 2 == 0 and size > 2:
            choices.append((2, size // 2))
        return {"shape": choices[rng.integers(len(choices))]}
    if op == "transpose":
        return {"axes": None if rng.integers(2) else tuple(int(i) for i in rng.permutation(ndim))}
    if op in ("sum", "mean"):
        options = [None] + list(range(ndim)) + list(range(-ndim, 0)) + ([(0, ndim - 1)] if ndim >= 2 else [])
        return {"axis": options[rng.integers(len(options))], "keepdims": bool(rng.integers(2))}
    return {}


def _compatible(op, sa, sb):
    if op in ("add", "sub", "mul", "div", "maximum", "mse", "pow_traced"):
        try:
            np.broadcast_shapes(sa, sb)
            return True
        except ValueError:
            return False
    if op == "matmul":
        return len(sa) >= 1 and len(sb) >= 1 and sa[-1] == sb[-2 if len(sb) >= 2 else 0]
    if op == "dot":
        return 1 <= len(sa) <= 2 and 1 <= len(sb) <= 2 and sa[-1] == sb[0]
    raise AssertionError(op)


def _run_program(program, inputs):
    values = list(inputs)
    for op, refs, params in program["steps"]:
        values.append(_apply(op, [values[r] for r in refs], params))
    total = 0.0
    for ref, weight in program["outputs"]:
        total = total + weight * ops.sum(values[ref])
    return total


def _generate_program(seed: int, steps: int = 8):
    """A random composition of the ops over three inputs with broadcast-compatible shapes.

    Candidates are evaluated with NumPy while generating, and rejected unless finite and
    moderate, so that finite differences stay accurate.
    """
    rng = np.random.default_rng(seed)
    shape_sets = [[(3, 4), (4,), (4, 3)], [(3, 1), (1, 4), ()], [(2, 3), (3,), (2, 1)], [(4,), (4,), (4, 2)]]
    shapes = shape_sets[seed % len(shape_sets)]
    inputs = [rng.uniform(-1.5, 1.5, size=s) for s in shapes]
    values = list(inputs)
    program = {"shapes": shapes, "steps": [], "outputs": []}
    while len(program["steps"]) < steps:
        if rng.random() < 0.5:
            op = UNARY[rng.integers(len(UNARY))]
            refs = [int(rng.integers(len(values)))]
            shape = values[refs[0]].shape
            params = _random_params(rng, op, shape)
        else:
            op = BINARY[rng.integers(len(BINARY))]
            refs = [int(rng.integers(len(values))), int(rng.integers(len(values)))]
            if not _compatible(op, values[refs[0]].shape, values[refs[1]].shape):
                continue
            params = {}
        with np.errstate(all="ignore"):
            value = np.asarray(_apply(op, [values[r] for r in refs], params))
        if not np.all(np.isfinite(value)) or np.abs(value).max(initial=0) > 20:
            continue
        if op in ("relu", "maximum") and np.abs(value).min(initial=1) < 1e-3:
            continue  # keep kinks away from finite-difference steps
        program["steps"].append((op, refs, params))
        values.append(value)
    last = len(values) - 1
    chosen = {last, int(rng.integers(3, last + 1)), int(rng.integers(0, 3))}
    program["outputs"] = [(ref, float(rng.uniform(0.5, 1.5))) for ref in sorted(chosen)]
    return program, inputs


def _finite_differences(fun, inputs, eps=1e-6):
    grads = []
    for k, x in enumerate(inputs):
        g = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            shifted = [a.copy() for a in inputs]
            shifted[k][index] = x[index] + eps
            up = float(fun(*shifted))
            shifted[k][index] = x[index] - eps
            down = float(fun(*shifted))
            g[index] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def _torch_autograd(fun, inputs):
    tensors = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in inputs]
    out = fun(*tensors)
    grads = torch.autograd.grad(out, tensors, allow_unused=True)
    return [np.zeros(x.shape) if g is None else g.numpy() for g, x in zip(grads, inputs)]


PROGRAM_SEEDS = range(40)


@pytest.mark.parametrize("seed", PROGRAM_SEEDS)
def test_random_programs_match_torch_autograd_and_finite_differences(seed):
    program, inputs = _generate_program(seed)

    def fun(*args):
        return _run_program(program, args)

    snapshots = [x.copy() for x in inputs]
    reference = _torch_autograd(fun, inputs)
    numeric = _finite_differences(fun, inputs)
    results = {}
    for mode in ACCUMULATE_MODES:
        value, grads = value_and_grad(fun, (0, 1, 2), accumulate=mode)(*inputs)
        results[mode] = grads
        assert np.allclose(value, fun(*inputs), rtol=1e-12, atol=0)
        for g, x, ref, fd in zip(grads, inputs, reference, numeric):
            assert g.shape == x.shape and g.dtype == np.float64, program
            np.testing.assert_allclose(g, ref, rtol=1e-9, atol=1e-10, err_msg=str(program))
            np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6, err_msg=str(program))
    for inplace, deferred in zip(results["inplace"], results["deferred"]):
        np.testing.assert_array_equal(inplace, deferred)
    for x, snapshot in zip(inputs, snapshots):
        np.testing.assert_array_equal(x, snapshot)


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_random_programs_on_torch_tensors_match_torch_autograd(seed):
    program, inputs = _generate_program(seed)

    def fun(*args):
        return _run_program(program, args)

    reference = _torch_autograd(fun, inputs)
    grads = grad(fun, (0, 1, 2))(*[torch.tensor(x) for x in inputs])
    for g, ref in zip(grads, reference):
        assert isinstance(g, torch.Tensor) and not g.requires_grad
        np.testing.assert_allclose(g.numpy(), ref, rtol=1e-9, atol=1e-10, err_msg=str(program))


def test_generated_programs_cover_every_op():
    used = {op for seed in PROGRAM_SEEDS for op, _, _ in _generate_program(seed)[0]["steps"]}
    assert used == set(UNARY) | set(BINARY)


# ---------------------------------------------------------------------------------------------
# Graph shapes: fan-out, diamonds, broadcasting, reductions
# ---------------------------------------------------------------------------------------------


def test_high_fan_out_one_input_used_100_times():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 6))
    scales = np.linspace(-1.0, 1.0, 100)

    def fun(x):
        total = 0.0
        for c in scales:
            total = total + ops.sum(ops.tanh(x * float(c)))
        return total

    expected = sum(c * (1 - np.tanh(c * x) ** 2) for c in scales)
    peaks = {}
    for mode in ACCUMULATE_MODES:
        df = grad(fun, accumulate=mode)
        np.testing.assert_allclose(df(x), expected, rtol=1e-12, atol=1e-12)
        assert (df.stats.buffers_created, df.stats.inplace_adds, df.stats.live_bytes) == (1, 98, 0)
        peaks[mode] = df.stats.peak_bytes
    block, scalar = x.nbytes, np.dtype(np.float64).itemsize
    # deferred keeps every contribution to the end: per use, the gradients of sum, tanh and
    # multiply's contribution to x (3 blocks), then x's sum buffer, and the 0-d seed that `+`
    # passes on unchanged. inplace: x's buffer, the first contribution it is made from, the new
    # one, the gradient passed back, and the 0-d gradient pending at the next `+`.
    assert peaks == {"deferred": 301 * block + scalar, "inplace": 4 * block + scalar}


def test_diamond():
    x = np.array([0.3, -0.7, 1.1])

    def fun(x):
        a = ops.tanh(x)
        return ops.sum(a * a * ops.exp(a))

    t = np.tanh(x)
    expected = (2 * t * np.exp(t) + t * t * np.exp(t)) * (1 - t * t)
    for mode in ACCUMULATE_MODES:
        np.testing.assert_allclose(grad(fun, accumulate=mode)(x), expected, rtol=1e-13)


def test_broadcasting_reduces_gradients_to_input_shapes():
    rng = np.random.default_rng(2)
    row, column, scalar = rng.standard_normal((1, 4)), rng.standard_normal((3, 1)), np.array(0.5)

    def fun(row, column, scalar):
        return ops.sum(ops.tanh(row * column + scalar) * row)

    grads = grad(fun, (0, 1, 2))(row, column, scalar)
    reference = _torch_autograd(fun, [row, column, scalar])
    for g, x, ref in zip(grads, (row, column, scalar), reference):
        assert g.shape == x.shape
        np.testing.assert_allclose(g, ref, rtol=1e-12)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2), (1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions_over_axes(reduction, axis, keepdims):
    x = np.random.default_rng(3).standard_normal((2, 3, 4))
    weights = np.random.default_rng(4).standard_normal(np.sum(x, axis=axis, keepdims=keepdims).shape)
    reduce = getattr(ops, reduction)

    def fun(x, weights):
        return ops.sum(ops.tanh(reduce(x, axis=axis, keepdims=keepdims)) * weights)

    reference = _torch_autograd(lambda x: fun(x, torch.tensor(weights)), [x])[0]
    np.testing.assert_allclose(grad(fun)(x, weights), reference, rtol=1e-12)
    np.testing.assert_allclose(grad(fun)(torch.tensor(x), torch.tensor(weights)).numpy(), reference, rtol=1e-12)


def test_matmul_shapes_and_transpose():
    rng = np.random.default_rng(5)
    cases = [((3, 4), (4,)), ((4,), (4, 2)), ((4,), (4,)), ((2, 3, 4), (4, 5)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,))]
    for sa, sb in cases:
        a, b = rng.standard_normal(sa), rng.standard_normal(sb)

        def fun(a, b):
            return ops.sum(ops.tanh(ops.matmul(a, b)))

        for g, ref in zip(grad(fun, (0, 1))(a, b), _torch_autograd(fun, [a, b])):
            np.testing.assert_allclose(g, ref, rtol=1e-12, err_msg=f"{sa} @ {sb}")
    m = rng.standard_normal((3, 5))

    def gram(m):
        return ops.sum(ops.tanh((m.T @ m) * ops.transpose(m.T @ m, (1, 0))))

    np.testing.assert_allclose(grad(gram)(m), _torch_autograd(gram, [m])[0], rtol=1e-12)


def test_losses_match_torch():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((5, 3))
    labels = np.array([0, 2, 1, 1, 0])
    probabilities = np.exp(rng.standard_normal((5, 3)))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    target = rng.standard_normal((5, 3))
    for lab in (labels, probabilities):
        t_logits = torch.tensor(logits, requires_grad=True)
        expected = torch.nn.functional.cross_entropy(t_logits, torch.tensor(lab))
        expected.backward()
        value, g = value_and_grad(lambda z: ops.softmax_cross_entropy(z, lab))(logits)
        np.testing.assert_allclose(value, expected.item(), rtol=1e-12)
        np.testing.assert_allclose(g, t_logits.grad.numpy(), rtol=1e-12)
        g_torch = grad(lambda z: ops.softmax_cross_entropy(z, torch.tensor(lab)))(torch.tensor(logits))
        np.testing.assert_allclose(g_torch.numpy(), t_logits.grad.numpy(), rtol=1e-12)
    t_pred, t_target = torch.tensor(logits, requires_grad=True), torch.tensor(target, requires_grad=True)
    torch.nn.functional.mse_loss(t_pred, t_target).backward()
    g_pred, g_target = grad(ops.mse, (0, 1))(logits, target)
    np.testing.assert_allclose(g_pred, t_pred.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(g_target, t_target.grad.numpy(), rtol=1e-12)


def test_arrays_on_the_left_of_operators_defer_to_traced_values():
    x = np.array([1.0, 2.0])
    np.testing.assert_allclose(grad(lambda x: ops.sum(np.array([3.0, 4.0]) * x - np.ones(2) / x))(x), [4.0, 4.25])
    tx = torch.tensor([1.0, 2.0])
    g = grad(lambda x: ops.sum(torch.tensor([3.0, 4.0]) * x - torch.ones(2) / x))(tx)
    np.testing.assert_allclose(g.numpy(), [4.0, 4.25])


# ---------------------------------------------------------------------------------------------
# In place: what is never written, and what the counters say
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ACCUMULATE_MODES)
def test_caller_inputs_returned_and_captured_arrays_are_never_mutated(mode):
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    captured = rng.standard_normal((4, 4))
    returned = {}
    snapshots = [a.copy() for a in (x, w, captured)]

    def fun(x, w):
        # The backward pass starts from the last term: there `+` hands one gradient array to x
        # and to w as their first contributions. An engine that then added x's later
        # contributions into that array would change w's gradient (and the hook's copy).
        h = x + w + captured
        returned["h"] = h.value
        return ops.sum(h * x) + ops.sum(ops.reshape(x, (16,))) + ops.sum(x @ captured) + ops.sum(x + w)

    seen = {}
    gx, gw = grad(fun, (0, 1), accumulate=mode, on_leaf_grad=lambda i, g: seen.setdefault(i, g.copy()))(x, w)
    np.testing.assert_allclose(gx, 2 * x + w + captured + 2 + np.ones((4, 4)) @ captured.T, rtol=1e-12)
    np.testing.assert_allclose(gw, x + 1, rtol=1e-12)
    np.testing.assert_array_equal(seen[0], gx)
    np.testing.assert_array_equal(seen[1], gw)
    h_snapshot = returned["h"].copy()
    for a, snapshot in zip((x, w, captured), snapshots):
        np.testing.assert_array_equal(a, snapshot)
    np.testing.assert_array_equal(returned["h"], h_snapshot)
    assert not np.may_share_memory(gx, gw)


def test_value_returned_by_fun_is_not_mutated():
    x = np.array(2.0)
    value, g = value_and_grad(lambda x: x)(x)
    assert value is x and float(x) == 2.0 and float(g) == 1.0


def test_gradients_of_different_arguments_never_share_memory():
    x, y = np.ones(3), np.ones(3)
    gx, gy = grad(lambda x, y: ops.sum(x + y), (0, 1))(x, y)
    assert not np.may_share_memory(gx, gy)
    tx, ty = grad(lambda x, y: ops.sum(x + y), (0, 1))(torch.ones(3), torch.ones(3))
    assert tx.untyped_storage().data_ptr() != ty.untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", ACCUMULATE_MODES)
def test_saved_values_are_released_as_soon_as_their_vjp_has_run(mode):
    """In a dot chain, when dot i's VJP is about to run, z_i (read only by dot i+1, whose VJP
    has run) must already be freed, while z_1 .. z_{i-1} are still held for the VJPs to come."""
    depth = 6
    alive_at = {}
    values = []

    def probe_vjp(level):
        def vjp(xp, g, saved):
            alive_at[level] = [ref() is not None for ref in values]
            return g

        return vjp

    def fun(x, z):
        for level in range(1, depth + 1):
            probe = Primitive(f"probe{level}", lambda xp, a: a, (probe_vjp(level),))
            z = probe(ops.dot(x, z))
            values.append(weakref.ref(z.value))
        return ops.sum(z)

    rng = np.random.default_rng(10)
    grad(fun, accumulate=mode)(rng.standard_normal((3, 3)), rng.standard_normal((3, 3)))
    assert alive_at == {level: [i < level - 1 for i in range(depth)] for level in range(1, depth + 1)}


def _dot_chain(depth):
    def chain(x, z):
        for _ in range(depth):
            z = ops.dot(x, z)
        return ops.sum(z)

    return chain


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dot_chain_peak_gradient_bytes_exact(library, dtype):
    """z_k = x @ z_(k-1), gradient w.r.t. x. In place, the peak is 4 blocks of D x D, whatever
    the depth: x's first contribution, the gradient being passed back, the new contribution to
    x and the buffer made from the two. Deferred keeps every contribution to the end: per dot,
    one to x and one to z_(k-1), so 2 * depth + 1 blocks (with x's sum buffer) plus the seed."""
    size = 5
    rng = np.random.default_rng(8)
    x, z = (rng.standard_normal((size, size)).astype(dtype) / size for _ in range(2))
    if library == "torch":
        x, z = torch.tensor(x), torch.tensor(z)
    block = size * size * np.dtype(dtype).itemsize
    seed = np.dtype(dtype).itemsize  # the 0-d gradient of the output
    for depth in range(1, 8):
        peaks, grads, after_node = {}, {}, {}
        for mode in ACCUMULATE_MODES:
            df = grad(_dot_chain(depth), accumulate=mode)
            grads[mode] = np.asarray(df(x, z))
            peaks[mode] = df.stats.peak_bytes
            after_node[mode] = df.stats.live_bytes_after_node
            assert df.stats.live_bytes == 0
            assert df.stats.nodes_run == depth + 1
        # in place: between nodes, the gradient on its way back and x's (first or accumulated)
        assert after_node["inplace"] == [block] + [2 * block] * (depth - 1) + [block]
        # deferred: two more blocks kept per dot; the last step ends at the peak (x is complete)
        assert after_node["deferred"][:-1] == [seed + block * (1 + 2 * k) for k in range(depth)]
        assert after_node["deferred"][-1] == peaks["deferred"]
        np.testing.assert_array_equal(grads["inplace"], grads["deferred"])
        if depth == 1:
            assert peaks == {"inplace": 2 * block, "deferred": 2 * block + seed}
        else:
            assert peaks == {"inplace": 4 * block, "deferred": (2 * depth + 1) * block + seed}, depth


def test_stats_count_buffers_and_adds():
    x = np.ones(3)
    df = grad(lambda x: ops.sum(x * 1.0 + x * 2.0 + x * 3.0 + x * 4.0))
    np.testing.assert_array_equal(df(x), np.full(3, 10.0))
    assert (df.stats.buffers_created, df.stats.inplace_adds) == (1, 2)
    assert df.stats.vjp_calls == 11 and df.stats.nodes_run == 8
    assert df.stats.to_dict()["accumulate"] == "inplace"
    assert (df.stats.library, df.stats.device, df.stats.dtype) == ("numpy", "cpu", "float64")


# ---------------------------------------------------------------------------------------------
# dtype
# ---------------------------------------------------------------------------------------------


def _scalar_heavy(x, zero_d):
    """Python scalars, NumPy/torch scalars and 0-d arrays mixed into a computation on x."""
    y = 2.0 * x**2 + zero_d * x - 1 / (x * x + 1.5) + zero_d**2
    return ops.mean(ops.tanh(y)) * zero_d + ops.sum(ops.maximum(y, 0.25)) / 3 + ops.sum(ops.relu(y - 1))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dtype_preserved_numpy(dtype):
    x = np.linspace(-1, 1, 6).astype(dtype).reshape(2, 3)
    for zero_d in (np.array(0.7), np.float64(0.7), np.array(0.7, dtype=np.float32), 0.7):
        value, g = value_and_grad(lambda x: _scalar_heavy(x, zero_d))(x)
        assert g.dtype == np.dtype(dtype) and np.asarray(value).dtype == np.dtype(dtype), type(zero_d)
    # the 0-d case from the autograd #219 thread: grad(x**2) at a 0-d float32 array
    g0 = grad(lambda x: x**2 * np.array(3.0))(np.array(3, dtype=dtype))
    assert g0.dtype == np.dtype(dtype) and g0.shape == () and float(g0) == 18.0
    assert grad(lambda x: x**2)(np.float32(3.0)).dtype == np.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_preserved_torch(dtype):
    x = torch.linspace(-1, 1, 6, dtype=dtype).reshape(2, 3)
    for zero_d in (torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.7, dtype=torch.float32), 0.7):
        value, g = value_and_grad(lambda x: _scalar_heavy(x, zero_d))(x)
        assert g.dtype == dtype and value.dtype == dtype, zero_d
    g0 = grad(lambda x: x**2 * torch.tensor(3.0, dtype=torch.float64))(torch.tensor(3.0, dtype=dtype))
    assert g0.dtype == dtype and g0.shape == () and float(g0) == 18.0


def test_gradient_takes_input_dtype_with_wider_constants():
    x = np.ones((2, 2), dtype=np.float32)
    g = grad(lambda x: ops.sum(x * np.full((2, 2), 3.0)))(x)  # float64 array constant: value promotes
    assert g.dtype == np.float32 and np.all(g == 3.0)


# ---------------------------------------------------------------------------------------------
# Leaf hook
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ACCUMULATE_MODES)
def test_leaf_hook_fires_once_per_leaf_with_final_gradient_before_backward_ends(mode):
    rng = np.random.default_rng(9)
    x, w1, w2, unused = (rng.standard_normal(s) for s in ((4, 3), (3, 3), (3, 2), (2,)))
    calls = []

    def fun(x, w1, w2, unused):
        h = ops.tanh(x @ w1)
        h = ops.tanh(h @ w1)  # w1 used twice: final only after the earlier use's VJP
        return ops.sum((h @ w2) ** 2)

    def hook(index, gradient):
        calls.append((index, gradient.copy(), df.stats.nodes_run))

    df = grad(fun, (0, 1, 2, 3), accumulate=mode, on_leaf_grad=hook)
    grads = df(x, w1, w2, unused)
    total_nodes = df.stats.nodes_run
    assert sorted(index for index, *_ in calls) == [0, 1, 2, 3]
    order = [index for index, *_ in calls]
    assert order.index(2) < order.index(1)  # w2's last use runs first in the backward pass
    for index, at_hook, _ in calls:
        np.testing.assert_array_equal(grads[index], at_hook)  # final: never changed afterwards
    nodes_at_hook = {index: nodes_run for index, _, nodes_run in calls}
    assert nodes_at_hook[2] < total_nodes  # fired while the backward pass was still running
    assert nodes_at_hook[2] < nodes_at_hook[1]
    np.testing.assert_array_equal(grads[3], np.zeros(2))
    for g, ref in zip(grads, _torch_autograd(fun, [x, w1, w2, unused])):
        np.testing.assert_allclose(g, ref, rtol=1e-12)


def test_leaf_hook_on_torch_and_for_an_output_independent_of_inputs():
    calls = []
    g = grad(lambda x: ops.sum(x * 3.0), on_leaf_grad=lambda i, g: calls.append((i, g.clone())))(torch.ones(2))
    assert len(calls) == 1 and calls[0][0] == 0 and torch.equal(calls[0][1], g)
    calls.clear()
    constant = grad(lambda x, y: ops.sum(y), 0, on_leaf_grad=lambda i, g: calls.append(i))(np.ones(2), np.ones(3))
    np.testing.assert_array_equal(constant, np.zeros(2))
    assert calls == [0]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_errors_are_clear_and_come_before_work():
    calls = []

    def fun(x, *rest):
        calls.append(1)
        return ops.sum(x)

    with pytest.raises(ValueError, match="'inplace', 'deferred'.*'eager'"):
        grad(fun, accumulate="eager")
    with pytest.raises(ValueError, match=r"argnum 2 is out of range .* 2 positional .*valid: 0\.\.1"):
        grad(fun, (0, 2))(np.ones(2), np.ones(2))
    with pytest.raises(TypeError, match="argnum must be"):
        grad(fun, -1)
    with pytest.raises(TypeError, match="argnum must be"):
        grad(fun, ())
    with pytest.raises(ValueError, match="repeats"):
        grad(fun, (0, 0))
    for bad in ([1.0, 2.0], 3.0, np.arange(3), torch.arange(3)):
        with pytest.raises(TypeError, match="grad differentiates NumPy arrays"):
            grad(fun)(bad)
    with pytest.raises(TypeError, match="one array library"):
        grad(fun, (0, 1))(np.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match="on_leaf_grad must be callable"):
        grad(fun, on_leaf_grad="print")
    assert calls == []
    with pytest.raises(ValueError, match=r"scalar .* got shape \(3,\)"):
        grad(lambda x: ops.tanh(x))(np.ones(3))
    with pytest.raises(TypeError, match="no data moves between libraries"):
        grad(lambda x: ops.sum(x * torch.ones(2)))(np.ones(2))
    with pytest.raises(TypeError, match="argument 1 cannot be differentiated"):
        grad(lambda z, y: ops.softmax_cross_entropy(z, y), (0, 1))(np.ones((2, 3)), np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="1-d or 2-d"):
        grad(lambda x: ops.sum(ops.dot(x, x)))(np.ones((2, 2, 2)))
    with pytest.raises(TypeError, match="higher-order gradients"):
        grad(lambda x: ops.sum(grad(lambda y: ops.sum(y * y))(x)))(np.ones(2))
    with pytest.raises(TypeError, match="must return a scalar"):
        grad(lambda x: (ops.sum(x), 1.0))(np.ones(2))


def test_ops_outside_grad_are_plain_array_functions():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(ops.sum(x, axis=1, keepdims=True), x.sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(ops.transpose(x), x.T)
    t = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(ops.mean(t, axis=0), t.mean(dim=0))
    assert torch.equal(ops.maximum(t, 2.0), torch.clamp_min(t, 2.0))
    assert ops.multiply(np.ones(3, dtype=np.float32), np.array(2.0)).dtype == np.float32  # the dtype rule


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_gradients_stay_on_device_and_match_cpu(dtype):
    for seed in range(0, 40, 8):
        program, inputs = _generate_program(seed)

        def fun(*args):
            return _run_program(program, args)

        cpu = grad(fun, (0, 1, 2))(*[torch.tensor(x, dtype=dtype) for x in inputs])
        cuda_inputs = [torch.tensor(x, dtype=dtype, device="cuda") for x in inputs]
        for mode in ACCUMULATE_MODES:
            grads = grad(fun, (0, 1, 2), accumulate=mode)(*cuda_inputs)
            for g, c in zip(grads, cpu):
                assert g.device.type == "cuda" and g.dtype == dtype
                tol = 1e-4 if dtype == torch.float32 else 1e-10
                np.testing.assert_allclose(g.cpu().numpy(), c.numpy(), rtol=tol, atol=tol)


@needs_cuda
@pytest.mark.cuda
def test_cuda_dot_chain_peak_bytes_exact():
    """The same counts as on the CPU (test_dot_chain_peak_gradient_bytes_exact): the ledger does
    not depend on the device."""
    depth = 5
    x = torch.randn(8, 8, device="cuda", dtype=torch.float64) / 8
    z = torch.randn(8, 8, device="cuda", dtype=torch.float64)
    block, seed = 8 * 8 * 8, 8
    for mode, expected in (("inplace", 4 * block), ("deferred", (2 * depth + 1) * block + seed)):
        df = grad(_dot_chain(depth), accumulate=mode)
        df(x, z)
        assert df.stats.peak_bytes == expected and df.stats.device == "cuda:0"
        on_cpu = grad(_dot_chain(depth), accumulate=mode)
        on_cpu(x.cpu(), z.cpu())
        assert on_cpu.stats.peak_bytes == expected
