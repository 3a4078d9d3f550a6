"""Add GPU-measured rows to fit's CUDA truth (results/reference/cuda-truth/), on a machine with an NVIDIA GPU:

    python tools/cuda_truth.py results/reference/cuda-truth/gpt2_124m.py --gpu h200 \\
        --engines torch,torch-autocast --at batch_size=8,16,32 -p seq_len=1024

Each engine's step at each value runs in a fresh process on the GPU, as `benchlib fit --device cuda` measures it
(one warm-up step and three measured ones; the caching allocator's reserved peak), and lands as a row of
NAME_GPU.csv beside the model file (NAME: the file's NAME; GPU: the `--gpu` name, one of `benchlib fit --gpu`'s). A
new table starts with a header saying how its rows were made: the card, driver, torch, CUDA and Python. Then
tests/test_cuda_truth.py predicts every row on the CPU and fails where a prediction is more than 5% off.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import sys
from pathlib import Path

FIXED = ("model", "engine")
MEASURED = ("reserved_bytes", "allocated_bytes", "source")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="tools/cuda_truth.py")
    parser.add_argument("model_file", type=Path, help="a model file in the torch form, in results/reference/cuda-truth/")
    parser.add_argument("--gpu", required=True, help="the card's name as `benchlib fit --gpu` knows it (h200, ...)")
    parser.add_argument("--engines", required=True, help="engines and combinations, as torch,torch-autocast")
    parser.add_argument("--at", required=True, metavar="NAME=V1,V2", help="the parameter and its values, one row each")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                        help="another parameter's value, the same in every row")
    return parser.parse_args(argv)


def _assignment(text: str, flag: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name.strip() or not value.strip():
        raise SystemExit(f"{flag} {text!r}: NAME=VALUE")
    return name.strip(), value.strip()


def header(gpu: str) -> str:
    """How a new table's rows are made, read from this machine."""
    import torch

    card = torch.cuda.get_device_properties(0)
    return (f"# GPU ground truth for fit's CUDA prediction, added by tools/cuda_truth.py. {card.name} "
            f"({card.total_memory // 2**20} MiB, --gpu {gpu}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"Python {platform.python_version()}, measured {datetime.date.today().isoformat()}.\n"
            "# Each row: the model file's step (its loss, batch and optimizer) under the engine, one warm-up step and "
            "three measured ones in a fresh process, as `benchlib fit --device cuda` measures them;\n"
            "# reserved_bytes = the caching allocator's reserved peak (torch.cuda.max_memory_reserved).\n")


def main(argv: list[str] | None = None) -> int:
    arguments = parse(argv)
    import torch

    from benchlib.engine_names import split_names
    from benchlib.fit.cuda_policy import gpu_named
    from benchlib.fit.measured import measure_step
    from benchlib.measure import resolve_device
    from benchlib.usermodel.loader import read_model_file

    if not torch.cuda.is_available():
        print("tools/cuda_truth.py: no CUDA GPU here; truth rows are measured on the GPU they name", file=sys.stderr)
        return 2
    try:
        gpu_named(arguments.gpu)
    except ValueError as error:
        print(f"tools/cuda_truth.py: --gpu: {error}", file=sys.stderr)
        return 2
    scale, listed = _assignment(arguments.at, "--at")
    values = [int(value) for value in listed.split(",")]
    fixed = dict(_assignment(text, "-p") for text in arguments.param)
    model_file = read_model_file(arguments.model_file)
    unknown = sorted({scale, *fixed} - set(model_file.parameters))
    if unknown:
        print(f"tools/cuda_truth.py: {', '.join(unknown)}: not parameters of {arguments.model_file.name} "
              f"({', '.join(model_file.parameters)})", file=sys.stderr)
        return 2
    table = arguments.model_file.with_name(f"{model_file.name}_{arguments.gpu}.csv")
    columns = [*FIXED, *sorted({scale, *fixed}), *MEASURED]
    if table.exists():
        with table.open(encoding="utf-8") as existing:
            present = next(csv.reader(line for line in existing if not line.startswith("#")))
        if present != columns:
            print(f"tools/cuda_truth.py: {table} has the columns {present}; these rows would have {columns}",
                  file=sys.stderr)
            return 2
    else:
        table.write_text(header(arguments.gpu) + ",".join(columns) + "\n", encoding="utf-8")
    device = resolve_device("cuda")
    base = {**model_file.parameters, **{name: type(model_file.parameters[name])(value)
                                        for name, value in fixed.items()}}
    for engine in split_names(arguments.engines):
        for value in values:
            outcome = measure_step(model_file, engine, {**base, scale: value}, device)
            said = outcome.reason or f"{outcome.total} bytes reserved"
            print(f"{model_file.name} {engine} {scale}={value}: {said}", flush=True)
            if not outcome.measured:
                continue
            row = {"model": model_file.name, "engine": engine, **{name: base[name] for name in (scale, *fixed)},
                   scale: value, "reserved_bytes": outcome.total, "allocated_bytes": "", "source": "benchlib"}
            with table.open("a", encoding="utf-8", newline="") as out:
                csv.writer(out).writerow([row[column] for column in columns])
    print(f"rows in {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
