"""Memory by module path, read back from a run's `module_bytes` records: which module holds the most of
a step's memory under each engine, by role, and its share of the bytes the roles account for."""

from __future__ import annotations

import json

import pandas as pd

from benchlib.records.metrics import GRADIENT_ROLE, MODULE_METRIC, OPTIMIZER_ROLE, PARAMETER_ROLE, SAVED_ROLE

ROLE_ORDER = (PARAMETER_ROLE, OPTIMIZER_ROLE, GRADIENT_ROLE, SAVED_ROLE)
ROLE_WORDS = {PARAMETER_ROLE: "parameters", OPTIMIZER_ROLE: "optimizer state", GRADIENT_ROLE: "gradients",
              SAVED_ROLE: "saved activations"}
TOTALS_COLUMNS = ["case", "engine", "module", *ROLE_ORDER, "total", "share"]


def module_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, engine, module, role): the median over trials of its bytes (a deterministic count:
    the trials agree)."""
    rows = records[records["metric"] == MODULE_METRIC]
    if rows.empty:
        return pd.DataFrame(columns=["case", "engine", "module", "role", "bytes"])
    params = rows["params"].map(json.loads)
    frame = pd.DataFrame({"case": rows["case"].to_numpy(), "engine": rows["variant"].to_numpy(),
                          "module": params.map(lambda p: p["module"]).to_numpy(),
                          "role": params.map(lambda p: p["role"]).to_numpy(),
                          "trial": params.map(lambda p: p.get("trial", 0)).to_numpy(),
                          "bytes": rows["value"].to_numpy(float)})
    per_trial = frame.groupby(["case", "engine", "module", "role", "trial"], sort=False)["bytes"].sum()
    return per_trial.groupby(level=["case", "engine", "module", "role"], sort=False).median().reset_index()


def module_totals(table: pd.DataFrame) -> pd.DataFrame:
    """Per (case, engine, module): bytes by role, their total, and the total's share of everything the engine's
    modules hold; largest first within an engine."""
    if table.empty:
        return pd.DataFrame(columns=TOTALS_COLUMNS)
    wide = (table.pivot_table(index=["case", "engine", "module"], columns="role", values="bytes", aggfunc="sum",
                              sort=False).reindex(columns=list(ROLE_ORDER)).fillna(0.0).reset_index())
    wide["total"] = wide[list(ROLE_ORDER)].sum(axis=1)
    whole = wide.groupby(["case", "engine"], sort=False)["total"].transform("sum")
    wide["share"] = (wide["total"] / whole).where(whole > 0)
    return (wide.sort_values(["case", "engine", "total"], ascending=[True, True, False], kind="stable")
            .reset_index(drop=True)[TOTALS_COLUMNS])


def largest_holder(totals: pd.DataFrame, case: str, engine: str) -> pd.Series | None:
    """The module holding the most under `engine` in `case` (its row of `module_totals`), or None."""
    rows = totals[(totals["case"] == case) & (totals["engine"] == engine)]
    return None if rows.empty else rows.iloc[0]


def holder_words(row: pd.Series) -> str:
    """"largest module blocks.3: 41% (mostly saved activations)": the summary line's words for `largest_holder`."""
    role = max(ROLE_ORDER, key=lambda name: row[name])
    return f"largest module {row['module']}: {100 * row['share']:.0f}% (mostly {ROLE_WORDS[role]})"
