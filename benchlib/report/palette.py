"""Which colour each series is drawn in: the same in every figure, notebook and run.

The engines are shared by every benchmark, so their colours live here. A benchmark's own series
(mnist_ensembles' strategies, calibration's libraries) are declared with it (`Benchmark(colors=...)`),
which registers them here; a name is drawn in one colour only, so a second colour for it is refused.
Every colour is dark enough to read on white. Any other name gets a stable colour from `PALETTE`,
which shares none of the fixed ones. No plotting library is imported: a declaration reads this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from benchlib.errors import Refused
from benchlib.engine_names import (AUTOGRAD, BENCHLIB_CHECKPOINT, BENCHLIB_DEFERRED, BENCHLIB_INPLACE, DEFAULT_COMBINATIONS,
                                   FUSED_OPTIMIZER,
                                   MANUAL, MANUAL_SEED, TORCH, TORCH_AUTOCAST, TORCH_CHECKPOINT, TORCH_COMPILE,
                                   TORCH_COMPILE_BUDGETS, TORCH_FUNC, TORCH_MICROBATCH, TORCH_OFFLOAD,
                                   TORCH_SAC)

ENGINES = "engines"
# group -> {series: colour}; `engines` first, then each benchmark that declared colours, by its name
SERIES_COLORS: dict[str, dict[str, str]] = {
    ENGINES: {
        MANUAL: "#222222",
        MANUAL_SEED: "#8c8c8c",
        BENCHLIB_INPLACE: "#1f77b4",
        BENCHLIB_DEFERRED: "#6a3d9a",
        BENCHLIB_CHECKPOINT: "#0f8b8d",
        AUTOGRAD: "#2ca02c",
        TORCH: "#d62728",
        TORCH_CHECKPOINT: "#e377c2",
        TORCH_COMPILE: "#ff7f0e",
        TORCH_FUNC: "#8c564b",
        FUSED_OPTIMIZER: "#9467bd",  # a user model file's engines, from here on
        TORCH_SAC: "#c51b7d",
        TORCH_AUTOCAST: "#d4a017",
        TORCH_MICROBATCH: "#1a9850",
        TORCH_OFFLOAD: "#5f6b7a",
        **dict(zip(TORCH_COMPILE_BUDGETS, ("#fdae6b", "#e6550d", "#8c2d04"))),  # torch.compile's orange, by budget
        # the combinations a model file's run adds by default (any other gets a fallback colour)
        **dict(zip(DEFAULT_COMBINATIONS, ("#b15928", "#cc4c02", "#66a61e", "#3690c0", "#ae017e", "#4d004b"))),
    },
}
PALETTE = ("#17becf", "#7f7f7f", "#bcbd22", "#393b79", "#843c39", "#637939", "#7b4173")


class PaletteError(Refused):
    """A series given a second colour, or a colour of the fallback palette."""


def register(group: str, colors: Mapping[str, str]) -> None:
    """`group`'s series colours (a benchmark's name and its `colors`); the same colour twice is fine."""
    for name, colour in colors.items():
        if colour in PALETTE:
            raise PaletteError(f"{group}: {name!r} is drawn in {colour}, a colour of the fallback palette {PALETTE}")
        known = known_colors().get(name)
        if known is not None and known != colour:
            raise PaletteError(f"{group}: {name!r} is already drawn in {known}, not {colour}")
    if colors:
        SERIES_COLORS.setdefault(group, {}).update(colors)


def known_colors() -> dict[str, str]:
    """Every fixed series colour, whichever group declared it."""
    return {name: colour for group in SERIES_COLORS.values() for name, colour in group.items()}


def color(name: str) -> str:
    """A colour for `name` that is the same in every figure, notebook and run."""
    known = known_colors().get(name)
    if known is not None:
        return known
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return PALETTE[digest[0] % len(PALETTE)]
