"""A wide table made readable: the columns that hold one value in every row are said once, above it,
instead of wrapping down every row (mnist_ensembles' `data`, a run's constant heap size)."""

from __future__ import annotations

from typing import Any

import pandas as pd


def constant_columns_apart(frame: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The table without the columns that hold one value in every row, and those values (a one-row
    table is left whole: every column of it is constant)."""
    if len(frame) < 2:
        return frame, {}
    same = {column: frame[column].iloc[0] for column in frame.columns if frame[column].map(repr).nunique() == 1}
    return frame.drop(columns=list(same)), same


def every_row_text(same: dict[str, Any]) -> str:
    return "every row: " + ", ".join(f"{name}={value}" for name, value in same.items()) if same else ""


def compact(frame: pd.DataFrame, precision: int = 3):
    """A notebook's display of `frame`: constant columns in the caption, no index, `precision` digits."""
    shown, same = constant_columns_apart(frame)
    return shown.style.hide(axis="index").format(precision=precision, na_rep="—").set_caption(every_row_text(same))
