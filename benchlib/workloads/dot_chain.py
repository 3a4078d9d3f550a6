"""The dot chain of HIPS autograd #219: F(x, z) = sum(x·(x·(…·(x·z)))), gradient with respect to x.

`depth` dot products share one x, so x's gradient receives `depth` contributions: keeping them all
until the end (`benchlib-deferred`, autograd before its fix) costs about as much again as the
forward pass stores, accumulating them in place costs one buffer. The hand-written gradient
(`manual`, the seed's code) stores the z stack and pops it on the way back: the floor.

The seed's raw data (x = A·Aᵀ, A standard normal) overflows to inf/NaN after a few dozen
products, so x is scaled to spectral norm 1; the scale is recorded with every result.

Run every engine in a fresh process and print a table (every declared parameter is an option):

    python -m benchlib.workloads.dot_chain [--D 1000 --depth 100 --dtype float64 --engines manual,torch ...]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchlib.benchmark import Benchmark, Config, Parameter, ParameterError, Seed
from benchlib.engines import ENGINE_NAMES, get_engine
from benchlib.trials.cases import Cases, EngineComparison, comparison_parameters, comparison_rules, compare_engines
from benchlib.engines.gradients import save_gradient
from benchlib.engines.namespaces import segmentation_params
from benchlib.engine_names import BENCHLIB_DEFERRED, BENCHLIB_INPLACE, MANUAL, MANUAL_SEED
from benchlib.engines.roles import role_gauge, tape_roles
from benchlib.measure import Case, mark
from benchlib.analysis.seed_verdicts import RatioRule
from benchlib.report.tables.engine_summary import comparison_text

SEED_SIZES = {"D": 1000, "depth": 100}
# torch.compile runs when named: its compile in every fresh process (7-9 s at the seed's sizes) added 62 s to this
# notebook's default run, and it saves what eager torch saves here (docs/techniques.md)
DEFAULT_ENGINES = tuple(engine for engine in ENGINE_NAMES if not get_engine(engine).compiles)
DATA_SEED = 0  # the seed of x and z: every engine differentiates the same data
X_SCALING = "x = A·Aᵀ / λmax(A·Aᵀ), A standard normal (spectral norm 1); z standard normal"
TARGET = "benchlib.workloads.dot_chain:case"


def make_data(D: int, dtype: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """x (spectral norm 1), z and the factor x was scaled by, all built in float64 then cast."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((D, D))
    x = a @ a.T
    scale = 1.0 / float(np.linalg.eigvalsh(x)[-1])
    x *= scale
    z = rng.standard_normal((D, D))
    return x.astype(dtype), z.astype(dtype), scale


def chain_loss(xp, depth: int):
    """The seed's F, written once against the namespace `xp`; marks where its backward begins."""

    def loss(x, z):
        mark("forward")
        z = xp.chain(lambda z: xp.dot(x, z), z, depth)
        total = xp.sum(z)
        mark("backward")
        return total

    return loss


def _stored_forward(xp, x, z, depth: int):
    """The forward pass both hand-written gradients share: z ← x·z, `depth` times, every input kept."""
    mark("forward")
    z_stack = []
    for _ in range(depth):
        z_stack.append(z)
        z = xp.dot(x, z)
    return z_stack, z


def manual_gradient(xp, depth: int):
    """The lean hand-written gradient (engine `manual`, the floor): store the z stack, pop it on
    the way back, accumulate g_x in place, keep nothing else."""

    def gradient(x, z):
        z_stack, z = _stored_forward(xp, x, z, depth)
        mark("backward")
        g_z = xp.ones_like(z)
        g_x = None
        for _ in range(depth):
            z = z_stack.pop()
            contribution = xp.dot(g_z, z.T)
            if g_x is None:
                g_x = contribution
            else:
                g_x += contribution
            g_z = xp.dot(x.T, g_z)
        return g_x

    return gradient


def manual_seed_gradient(xp, depth: int):
    """The seed's own hand-written gradient (engine `manual-seed`), as its author wrote it in
    autograd #219, with its buffer lifetimes: unlike `manual` it keeps both VJP results (tmp_g0,
    tmp_g1) alive until the next step overwrites them, rebuilds g_z as 0 + tmp_g1 (a copy) at
    every step, and starts g_x from 0 (its first contribution is copied)."""

    def gradient(x, z):
        z_stack, z = _stored_forward(xp, x, z, depth)
        retval = xp.sum(z)
        mark("backward")
        g_x = 0
        g_z = xp.ones_like(z) * 1  # repeat_to_match_shape(g_retval, z): ones of z's shape times g_retval
        for _ in range(depth):
            z = z_stack.pop()
            tmp_g0 = xp.dot(g_z, z.T)  # grad_dot_A(g_z, x, z)
            tmp_g1 = xp.dot(x.T, g_z)  # grad_dot_B(g_z, x, z)
            g_z = 0
            g_x += tmp_g0
            g_z += tmp_g1
        return g_x

    return gradient


def hand_written_gradients(xp, depth: int) -> dict:
    """The hand-written engines' gradients, by engine name: `manual` the lean floor, `manual-seed`
    the seed's own code (pass as `Engine.gradient(..., manual=...)`)."""
    return {MANUAL: manual_gradient(xp, depth), MANUAL_SEED: manual_seed_gradient(xp, depth)}


def z_stack_bytes(D: int, depth: int, dtype: str) -> int:
    """The floor: the `depth` intermediate z's every engine's forward pass stores (depth·D²·itemsize)."""
    return depth * D * D * np.dtype(dtype).itemsize


def memory_required_bytes(engine: str, D: int, depth: int, dtype: str) -> int:
    """What a case needs: the stored z stack (twice over when contributions are kept) and a few buffers."""
    stored = 2.2 if get_engine(engine).keeps_contributions else 1.2  # checkpointing engines need less: an upper bound
    return int(D * D * np.dtype(dtype).itemsize * (stored * depth + 8))


def case(*, device, engine: str, D: int, depth: int, dtype: str, gradient_dir: str, seed: int = 0) -> Case:
    """One engine's gradient call, set up in the isolation child.

    The check saves the last call's gradient to `gradient_dir` (the parent compares it with
    manual's) and reports the scale applied to x.
    """
    chosen = get_engine(engine)
    x_np, z_np, scale = make_data(D, dtype, seed)
    x, z = chosen.asarray(x_np, device), chosen.asarray(z_np, device)
    del x_np, z_np
    xp = chosen.namespace(device)
    gradient = chosen.gradient(chain_loss(xp, depth), 0, manual=hand_written_gradients(xp, depth))

    set_up = chosen.prepare(lambda: gradient(x, z), device)  # torch.compile compiles here, untimed by the trial

    def check(result) -> dict[str, float]:
        save_gradient(result, gradient_dir, engine)
        return {"x_scale": scale, **set_up, **tape_roles(gradient)}  # torch's saved bytes: the role pass's

    return Case(lambda: gradient(x, z), check, roles=role_gauge(chosen, gradient, inputs=(x, z)))


def run(config: Config, device="auto", *, timeout_s: float = 600, progress=print, results=None) -> EngineComparison:
    """Every engine's case in its own process, `trials` times interleaved; finished cases survive a failing one.
    `config` is this benchmark's (`BENCHMARK.config(...)`), checked where it was built."""
    D, depth, dtype = config.D, config.depth, config.dtype
    cases = Cases(BENCHMARK.name, TARGET, {f"D={D},depth={depth}": {"D": D, "depth": depth, "seed": DATA_SEED}},
                  memory_required=lambda engine, _params: memory_required_bytes(engine, D, depth, dtype),
                  describe={"x_scaling": X_SCALING},
                  engine_params=lambda engine, _params: segmentation_params(engine, depth))
    return compare_engines(cases, config, device=device, timeout_s=timeout_s, progress=progress, results=results)


def _memory(config, device) -> int:
    return max(memory_required_bytes(engine, config.D, config.depth, config.dtype) for engine in config.engines)


SEED = Seed("HIPS/autograd #219, \"Decreasing autograd memory usage\"", "https://github.com/HIPS/autograd/issues/219")


def chain_parameters(*, D: int, depth: int, quick_depth: int) -> tuple[Parameter, Parameter]:
    """The chain's sizes, declared alike by every benchmark of the dot chain."""
    return (Parameter("D", D, "side of the square matrices x and z", quick=64, minimum=1),
            Parameter("depth", depth, "chained dot products (x's gradient receives this many contributions)",
                      quick=quick_depth, minimum=1))


BENCHMARK = Benchmark(
    name="dot_chain",
    question="How much memory does a gradient of 100 chained dot products need, against a hand-written "
             "gradient? What does in-place accumulation save?",
    seed=SEED,
    notebook="dot_chain.ipynb",
    cases="one gradient of the chain per engine, each in fresh processes, `trials` times interleaved: peak above "
          "the baseline, memory over time, time, memory by role and the gradient's error against manual",
    parameters=(
        *chain_parameters(D=SEED_SIZES["D"], depth=SEED_SIZES["depth"], quick_depth=8),
        *comparison_parameters(dtype="float64", engines=DEFAULT_ENGINES, repeats=1, trials=5, warmup=0),
    ),
    rules=comparison_rules,
    memory=_memory,
    headline=("peak_bytes", "time"),
    verdicts=(
        RatioRule("dot_chain", "autograd #219: deferred accumulation peaks at about 2x the manual floor",
                  "peak_bytes", BENCHLIB_DEFERRED, MANUAL, 1.5, 2.5),
        RatioRule("dot_chain", "autograd #219: in-place accumulation peaks at the manual floor",
                  "peak_bytes", BENCHLIB_INPLACE, MANUAL, 0.9, 1.1),
        RatioRule("dot_chain", "autograd #219: deferred accumulation peaks at about 2x the seed's own hand-written "
                  "gradient", "peak_bytes", BENCHLIB_DEFERRED, MANUAL_SEED, 1.5, 2.5),
        RatioRule("dot_chain", "autograd #219: in-place accumulation peaks at the seed's own hand-written gradient",
                  "peak_bytes", BENCHLIB_INPLACE, MANUAL_SEED, 0.9, 1.1),
    ),
    metrics=(("x_scale", "", "setting", "scale applied to the dot chain's input so its values stay finite"),),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchlib.workloads.dot_chain",
        description=f"{BENCHMARK.question} Each engine in a fresh process; prints the peaks and times "
                    "(benchlib run dot_chain also draws the figures).")
    parser.add_argument("--device", default="cpu", help="cpu (the default), cuda, cuda:N or auto")
    for parameter in BENCHMARK.parameters:
        parser.add_argument(f"--{parameter.name}", nargs="+" if parameter.is_list else None, default=None,
                            help=f"{parameter.help}; default {list(parameter.default) if parameter.is_list else parameter.default}")
    values = vars(parser.parse_args(argv))
    device = values.pop("device")
    for parameter in BENCHMARK.parameters:  # a list may be given as several words or as one: --engines a b, a,b
        given = values[parameter.name]
        if given is not None:
            try:
                values[parameter.name] = parameter.parse(",".join(given) if parameter.is_list else given)
            except ParameterError as error:
                parser.error(str(error))
    try:
        config = BENCHMARK.config({name: value for name, value in values.items() if value is not None})
    except ParameterError as error:
        parser.error(str(error))
    comparison = run(config, device, progress=lambda line: print(line, file=sys.stderr))
    print(comparison_text(comparison))
    return 0 if comparison.ok else 1


if __name__ == "__main__":
    sys.exit(main())
