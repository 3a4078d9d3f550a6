"""The FLOP floor of one ensemble step at a measured matmul rate, and its records."""

from __future__ import annotations

import json

from benchlib.records import make_record
from benchlib.workloads.ensembles.config import EnsembleConfig
from benchlib.workloads.ensembles.common import NAME


def matmul_flops(device, n: int = 1024, repeats: int = 5) -> float:
    """Measured float32 torch matmul FLOP/s on ``device`` when the run has no calibration records:
    the calibration workload's own measurement (same method), read the same way."""
    from benchlib.records import records_frame
    from benchlib.workloads import calibration

    calibration.BENCHMARK.register()  # its records (the `library` kind, `flop_rate`) are made here, in this kernel
    rows = calibration.matmul_flops(device, sizes=[n], dtypes=["float32"], repeats=repeats)
    return calibration_flop_rate(records_frame(rows), device.name)


def calibration_flop_rate(records, device_name: str, threads: int | None = None) -> float | None:
    """Best median float32 torch matmul FLOP/s in a run's calibration records (the calibration
    notebook's ``flop_rate`` rows) on ``device_name``; None when the run has none. With ``threads``,
    only rows measured at that many torch threads: a floor taken at another thread count than the
    training's would be off by about their ratio on CPU."""
    from benchlib.workloads import calibration

    if records is None or len(records) == 0:
        return None
    rows = records[(records["benchmark"] == calibration.BENCHMARK.name) & (records["metric"] == "flop_rate")
                   & (records["variant"] == calibration.TORCH_LIBRARY) & (records["dtype"] == "float32")
                   & (records["device"] == device_name)]
    if threads is not None:
        rows = rows[rows["params"].map(lambda text: (json.loads(text) if text else {}).get("torch_threads") == threads)]
    if rows.empty:
        return None
    return float(rows.groupby("params")["value"].median().max())


def flop_floor(config: EnsembleConfig, flop_rate: float) -> dict:
    """The FLOP floor of one ensemble step at ``flop_rate`` FLOP/s, and the throughput ceiling."""
    flops_per_step = config.n_nets * config.batch * config.flops_per_model_sample
    return {"flop_rate": flop_rate, "flops_per_model_sample": config.flops_per_model_sample,
            "flops_per_step": flops_per_step, "floor_step_s": flops_per_step / flop_rate,
            "ceiling_model_samples_per_s": flop_rate / config.flops_per_model_sample}


def flop_floor_records(floor: dict, device, labels: dict) -> list[dict]:
    """Tidy rows of `flop_floor` (case and bound ``flop_floor``)."""
    common = dict(benchmark=NAME, case="flop_floor", bound="flop_floor", device=device, dtype="float32",
                  params=labels | floor)
    return [make_record(metric=metric, value=floor[metric], unit=unit, **common)
            for metric, unit in (("flop_rate", "FLOP/s"), ("floor_step_s", "s"),
                                 ("ceiling_model_samples_per_s", "model-samples/s"))]
