"""`benchlib.profile`: a model file, or its functions, measured from Python (a notebook) by the same
runner as `benchlib run`, the results handed back as frames and figures rather than printed.

Not named profile.py: the runner's folder is on its notebooks' path, where that name would hide the
standard library's `profile` (which torch.func imports)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from benchlib.errors import Failed
from benchlib.report.page import HEADLINE_SUFFIX, SUMMARY_COLUMN
from benchlib.usermodel.template import write_model_file

@dataclass(frozen=True)
class Profile:
    """One run of a model file: its records, summary table, figures and run directory."""

    records: pd.DataFrame
    summary: pd.DataFrame
    figures: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @property
    def sites(self) -> pd.DataFrame:
        """With `attribute=True`: one row per allocation site (engine as `variant`, kind peak, temporary or
        allocated, site, function, bytes, count, share; the user's own lines marked `own`); else empty."""
        from benchlib.analysis.sites import site_table

        return site_table(self.records)

    @property
    def diffs(self) -> pd.DataFrame:
        """With `attribute=True`: each engine's sites at the peak against eager torch's, site by site."""
        from benchlib.analysis.sites import diff_table

        return diff_table(self.records)

    @property
    def lines(self) -> list[str]:
        """The summary as the lines `benchlib run` prints."""
        return list(self.summary[SUMMARY_COLUMN])


def profile(model: str | Path | Mapping[str, Any], *, engines: Sequence[str] | None = None, quick: bool = False,
            device: str = "auto", out: str | Path | None = None, attribute: bool = False, **params: Any) -> Profile:
    """Measure a model file (a path, or a mapping of its functions and values) as `benchlib run` does, in
    a fresh run directory under `out` (default results/); `params` override its PARAMETERS. `attribute`
    adds the attribution pass (`benchlib run --attribute`): `Profile.sites` and `Profile.diffs`."""
    from benchlib import registry
    from benchlib.records import load_records
    from benchlib.runner.execute import run

    with tempfile.TemporaryDirectory(prefix="benchlib-profile-") as folder:
        path = write_model_file(model, folder) if isinstance(model, Mapping) else Path(model)
        values = {**params, **({"engines": list(engines)} if engines is not None else {})}
        result = run([str(path)], device=device, quick=quick, out=out, params=values, progress=False,
                     attribute=attribute)
        benchmark = registry.resolve(str(path))
    if not result.notebooks or result.notebooks[0].status in ("failed", "not run"):
        raise Failed(f"{path}: the run failed: {result.notebooks[0].error if result.notebooks else result.path}")
    records = load_records(result.path)
    summary = pd.read_parquet(result.path / "tables" / f"{benchmark.name}{HEADLINE_SUFFIX}.parquet")
    figures = {name: build(records) for name, build in benchmark.figures.items()}
    return Profile(records, summary, figures, result.path)
