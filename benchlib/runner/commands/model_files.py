"""`benchlib new` and `benchlib fit`: write a commented example model file; the largest value of a model
file's parameter that fits a memory limit, printed, with its records, figure and report in a run directory."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchlib.engine_names import split_names
from benchlib.errors import EXIT_FAILED, EXIT_OK
from benchlib.fit.cuda_policy import DEFAULT_GPU, GPUS, TORCH_RULES
from benchlib.fit.settings import QUICK, THOROUGH, Search
from benchlib.runner.arguments import RunnerError, parse_assignments, ranks_params

EXIT_FITS, EXIT_NONE_FITS = EXIT_OK, EXIT_FAILED


def add_commands(commands, common: Sequence[argparse.ArgumentParser]) -> None:
    new_parser = commands.add_parser(
        "new", parents=common, help="write a commented example model file to run with `benchlib run FILE`")
    new_parser.add_argument("file", type=Path, metavar="FILE", help="the .py file to write (never overwritten)")
    new_parser.add_argument("--from", dest="source", default=None, metavar="NAME",
                            help="write the model file a name stands for (hf:NAME_OR_PATH, tv:NAME, timm:NAME), to "
                                 "change its loss, batch or optimizer: `benchlib fit FILE` then answers as the name")
    new_parser.add_argument("--form", choices=("torch", "arrays"), default="torch",
                            help="torch: an nn.Module, a batch and a loss; arrays: NumPy arrays and a loss over xp, "
                                 "run under benchlib's engines, HIPS autograd, torch and torch.func (default: torch)")
    new_parser.set_defaults(handler=lambda arguments: _new(arguments.file, arguments.form, arguments.source))

    fit_parser = commands.add_parser(
        "fit", parents=common, help="the largest batch (or sequence length) a model file's step fits in a memory limit",
        description="Measure the step of a model file under each engine at an eighth, a quarter, a half and all of "
                    "the --scale parameter's value (one fresh process each), fit each engine's total memory with a "
                    "size model checked on the point it did not see, measure toward the answer, confirm it by "
                    "measurement where this machine holds --memory, and print two answers: the largest value and its "
                    "engine, and the fastest engine at the largest value every engine reaches. The combinations "
                    "-p combinations adds (default: the ones users reach for) are predicted from a trace and measured "
                    "where they pass every measured engine. Total memory: "
                    "the allocator's reserved peak on CUDA, the process's resident high-water mark on the CPU. "
                    "--device cuda on a machine without a GPU predicts instead: each engine's step traced under fake "
                    "tensors and replayed through a model of the caching allocator, labelled 'predicted, not "
                    "measured on a GPU'. Exit status: 0 some engine fits, 1 none fits at the smallest value (or none "
                    "could be measured or predicted), 2 refused.")
    fit_parser.add_argument("file", metavar="FILE", help="a model file in the torch form (see `benchlib new`)")
    fit_parser.add_argument("--memory", default=None, metavar="SIZE",
                            help="the limit: '24 GB', '80 GiB', bytes (with --gpu, default: that card's memory)")
    fit_parser.add_argument("--scale", metavar="PARAM",
                            help="an integer parameter of the file that memory grows with (batch_size, seq_len)")
    fit_parser.add_argument("--at", metavar="PARAM=VALUE",
                            help="instead of the largest value: which engines fit this one (the batch you have), "
                                 "fastest first; exit 0 if any fits, 1 if none")
    fit_parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu); cuda without a GPU: predicted, not measured")
    fit_parser.add_argument("--gpu", default=None, metavar="NAME",
                            help="with --device cuda on a machine without a GPU: the card the prediction is for, whose "
                                 f"kernels the trace chooses ({', '.join(GPUS)}; default: {DEFAULT_GPU})")
    fit_parser.add_argument("--torch", default=None, metavar="VERSION",
                            help="with --device cuda on a machine without a GPU: the torch release whose CUDA kernel "
                                 f"choices the trace emulates ({', '.join(TORCH_RULES)}; default: the installed one's)")
    fit_parser.add_argument("--engines", default=None, metavar="A,B", help="engines and combinations to fit, as torch,torch-sac+torch-autocast (default: all of the form's, "
                                 "and the combinations -p combinations=default|all|none adds)")
    fit_parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                            help="a parameter value, as for run (the --scale one sets the largest value measured)")
    fit_parser.add_argument("--ranks", type=int, default=None, metavar="N",
                            help="the step on N torch.distributed ranks under --parallel: the answer is per rank, each "
                                 "measured on real ranks (gloo on the CPU; a GPU per rank on CUDA); same as -p ranks=N")
    fit_parser.add_argument("--parallel", default=None, metavar="ddp,fsdp",
                            help="with --ranks: the parallel strategies each engine runs under (same as -p parallel=)")
    fit_parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                            help="measure the answer in fresh processes before giving it, searching the true largest "
                                 "value (default: on wherever this machine can hold --memory; --no-verify skips)")
    fit_parser.add_argument("--quick", action="store_true",
                            help=f"a first look, fewer processes: the {QUICK.summary} (default: the "
                                 f"{THOROUGH.summary})".replace("%", "%%"))
    fit_parser.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                            help="the longest each of fit's processes may take (a measured step, a trace): one that "
                                 "runs longer is killed and said, and fit goes on (default: BENCHLIB_FIT_TIMEOUT, else "
                                 "600; reading and checking the file: BENCHLIB_FORM_CHECK_TIMEOUT, as for run)")
    fit_parser.add_argument("--margin", default="0", metavar="SHARE",
                            help="headroom kept free of the limit: '10%%' or 0.1 (default: none)")
    fit_parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                            help="root for the run directory its records and report go to (default: results/)")
    fit_parser.set_defaults(handler=fit_command)


def _new(path: Path, form: str, source: str | None = None) -> int:
    from benchlib.usermodel.named import model_file_text
    from benchlib.usermodel.template import ARRAY_TEMPLATE, TEMPLATE

    if path.suffix != ".py":
        raise RunnerError(f"{path}: a model file ends in .py")
    if source is not None and form != "torch":
        raise RunnerError(f"--from {source} writes a model file in the torch form; leave out --form {form}")
    exists = RunnerError(f"{path} exists; benchlib new never overwrites a file (choose another name)")
    if path.exists():  # before a name's library is imported
        raise exists
    text = model_file_text(source) if source is not None else ARRAY_TEMPLATE if form == "arrays" else TEMPLATE
    try:
        with open(path, "x", encoding="utf-8") as file:
            file.write(text)
    except FileExistsError:
        raise exists from None
    except OSError as error:
        raise RunnerError(f"{path} cannot be written: {error.strerror}") from None
    print(f"wrote {path}; try it: benchlib run {path} --quick")
    return 0


def _seconds(text: str) -> float:
    """A positive number of seconds, or argparse's refusal saying what is valid."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _share(text: str) -> float:
    """'10%' or '0.1' as 0.1; anything else refused, saying what is valid."""
    from benchlib.fit import FitError

    try:
        return float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise FitError(f"--margin {text!r}: a share of the limit, as '10%' or 0.1") from None


def fit_command(arguments: argparse.Namespace) -> int:
    """Fit, print, save; 0 when some engine fits, 1 when none fits at the smallest value, none could be fitted or an
    engine asked for failed (refusals raise). pandas and the run's records are imported once the question is asked."""
    from benchlib.fit import FitError, FitInterrupted, MemoryLimit, fit
    from benchlib.fit.asking import TIMEOUT_ENV
    from benchlib.measure import resolve_device
    from benchlib.records.places import now_iso

    file, scale, device = arguments.file, arguments.scale, arguments.device
    chosen = None if arguments.engines is None else split_names(arguments.engines)
    if (scale is None) == (arguments.at is None):
        raise FitError("give --scale PARAM (the largest value that fits) or --at PARAM=VALUE (which engines fit that "
                       "value), one of them")
    from benchlib.records.places import check_out_dir, default_results_root

    check_out_dir(arguments.out or default_results_root())  # before anything is measured, as `run` refuses it
    if arguments.timeout is not None:  # read by every process fit starts, as BENCHLIB_FORM_CHECK_TIMEOUT is
        os.environ[TIMEOUT_ENV] = str(arguments.timeout)
    started, started_at = time.monotonic(), now_iso()
    search = (QUICK if arguments.quick else THOROUGH).verifying(arguments.verify)
    if arguments.at is not None:
        return _fit_at(arguments, chosen, started, started_at, search)
    try:
        result = fit(file, memory=MemoryLimit(arguments.memory, _share(arguments.margin), arguments.gpu, arguments.torch), scale=scale,
                     device=device, engines=chosen, params=ranks_params(arguments, parse_assignments(arguments.param)),
                     search=search)
    except FitInterrupted as stopped:
        import pandas as pd

        _save_interrupted(arguments, stopped, f"{stopped.result.name}_fit", started, started_at,
                          pd.DataFrame(stopped.result.rows()))
    import pandas as pd

    print("\n".join(result.lines()))
    if search.name != THOROUGH.name:
        print(search.summary)
    from benchlib.report.figure_files import save_figure  # presentation, once the answer is measured
    from benchlib.report.page import HEADLINE_SUFFIX
    from benchlib.report.plots.usermodel import fit_figure

    question = (f"What is the largest {scale} at which {Path(file).name}'s step fits in {_limit(arguments)}, and under "
                "which engine?")
    ran_on = resolve_device("cpu" if result.predicted else device)  # a prediction runs on the CPU
    run, frame = _saved(arguments, result, f"{result.name}_fit", question, ran_on.name, started_at,
                        pd.DataFrame(result.rows()), HEADLINE_SUFFIX)
    if any(fit.model is not None for fit in result.engines):  # else nothing to draw: each engine says why
        save_figure(run, fit_figure(frame), f"{result.name}_fit")
    return _finished(run, arguments, f"{result.name}_fit", result, started,
                     EXIT_FITS if result.best is not None else EXIT_NONE_FITS)


def _fit_at(arguments: argparse.Namespace, chosen: list[str] | None, started: float, started_at: str,
            search: Search) -> int:
    """`fit --at`: every engine at the value, printed fastest first among those that fit, saved as a run."""
    import pandas as pd

    from benchlib.fit import FitInterrupted, MemoryLimit, fit_at

    try:
        result = fit_at(arguments.file, memory=MemoryLimit(arguments.memory, _share(arguments.margin), arguments.gpu, arguments.torch),
                        at=arguments.at,
                        device=arguments.device, engines=chosen,
                        params=ranks_params(arguments, parse_assignments(arguments.param)), search=search)
    except FitInterrupted as stopped:
        from benchlib.report.page import SUMMARY_COLUMN

        _save_interrupted(arguments, stopped, f"{stopped.result.name}_fit_at", started, started_at,
                          pd.DataFrame({SUMMARY_COLUMN: stopped.result.lines()}))
    from benchlib.report.page import HEADLINE_SUFFIX, SUMMARY_COLUMN  # presentation, once the answer is measured

    print("\n".join(result.lines()))
    question = (f"Which engines fit {Path(arguments.file).name}'s step at {result.scale}={result.value} in "
                f"{_limit(arguments)}, and which is fastest?")
    run, _ = _saved(arguments, result, f"{result.name}_fit_at", question, result.device, started_at,
                    pd.DataFrame({SUMMARY_COLUMN: result.lines()}), HEADLINE_SUFFIX)
    return _finished(run, arguments, f"{result.name}_fit_at", result, started,
                     EXIT_FITS if result.fitting else EXIT_NONE_FITS)


def _limit(arguments: argparse.Namespace) -> str:
    """The limit as the command was given it: --memory, else the --gpu card's memory."""
    return arguments.memory or f"{arguments.gpu}'s memory"


def _saved(arguments: argparse.Namespace, result, name: str, question: str, device: str, started_at: str,
           headline, suffix: str):
    """A run directory started when the command started, holding the result's records (none where an interrupt came
    before the first was measured: the frame is then None) and its headline table."""
    from benchlib.records import Run
    from benchlib.records.places import default_results_root

    run = Run.create(arguments.out or default_results_root(), device, device_requested=arguments.device,
                     notebooks={}, benchmarks={name: {"question": question}}, command=["benchlib", *arguments.argv],
                     started_at=started_at)
    records = result.records()
    frame = run.save_records(records, result.name) if records else None
    run.save_table(headline, f"{result.name}{suffix}")
    return run, frame


def _save_interrupted(arguments: argparse.Namespace, stopped, name: str, started: float, started_at: str,
                      headline) -> None:
    """Ctrl-C (or SIGTERM) during a fit: what it measured saved as an interrupted run, with its report, then the
    interrupt goes on to the command's end (exit 130)."""
    from benchlib.report.page import HEADLINE_SUFFIX, write_report

    result = stopped.result
    run, frame = _saved(arguments, result, name, f"{Path(arguments.file).name}'s fit, interrupted", result.device,
                        started_at, headline, HEADLINE_SUFFIX)
    run.record_notebook(name, status="interrupted", benchmarks=[result.name] if frame is not None else [],
                        path=str(Path(arguments.file).resolve()), duration_s=round(time.monotonic() - started, 3))
    run.finish(interrupted=True, interrupted_by=stopped.signal_name or "KeyboardInterrupt")  # as a run's run.json says
    what = "what was measured is in" if frame is not None else "before anything was measured; the run, marked so, is"
    print(f"interrupted: {what} {run.path} (report: {write_report(run.path)})", file=sys.stderr)
    raise KeyboardInterrupt from stopped


def _finished(run, arguments: argparse.Namespace, name: str, result, started: float, status: int) -> int:
    """The run closed (no seed rule applies to a fit, so its verdicts are empty) and its report written; a fit that
    exits 1 (nothing fits, or nothing could be measured) is listed as failed, its answer the reason; one whose answer
    stands without an engine asked for, whose step failed, is `partial` and exits 1 too."""
    import pandas as pd

    from benchlib.analysis.seed_verdicts import save_verdicts
    from benchlib.report.page import write_report

    broken = result.failed_engines
    if status != EXIT_FITS:
        state, failed = "failed", {"error": result.lines()[0]}
    elif broken:  # an answer without an engine that was asked for: said, and never exit 0
        state, failed = "partial", {"error": f"{len(broken)} engine(s) failed: {', '.join(broken)} (each line says why); "
                                             "the answer is among the others"}
        status = EXIT_FAILED
    else:
        state, failed = "ok", {}
    run.record_notebook(name, status=state, benchmarks=[result.name],
                        path=str(Path(arguments.file).resolve()), duration_s=round(time.monotonic() - started, 3),
                        **failed)
    save_verdicts(pd.DataFrame(), run.path)
    run.finish(interrupted=False)
    print(f"report: {write_report(run.path)}")
    if state == "partial":
        print(f"benchlib: {failed['error']}", file=sys.stderr)
    return status
