"""The `benchlib` command: the parser its families of subcommands build (`benchlib.runner.commands`), the
dispatch to the one named, and every error ending as one line (its traceback with --debug)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from benchlib.runner.commands import FAMILIES
from benchlib.runner.startup import skip_iri_grammars

EXIT_REFUSED = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchlib",
        description="Run the benchmark notebooks through papermill and keep their results in results/<run-id>/.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true",
                       help="on an error, also print its traceback (without it, every error is one line)")
    for family in FAMILIES:
        family.add_commands(commands, [debug])
    return parser


def _print_chain(error: BaseException) -> None:
    """The refusal's traceback and those of the errors behind it, the original first (for --debug)."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    for link in reversed(chain):
        traceback.print_exception(type(link), link, link.__traceback__, chain=False)
        if getattr(link, "child_traceback", ""):  # raised in a child process: where, in that child
            print(f"--- in the child process ---\n{link.child_traceback.rstrip()}", file=sys.stderr)


def one_line(error: BaseException) -> str:
    """What went wrong, for a user: a refusal's own message (it says what is valid); for an OS error
    the file and what is wrong with it; anything else by its type (a bug: --debug shows where)."""
    if isinstance(error, OSError) and error.filename is not None:
        files = f"{error.filename} -> {error.filename2}" if error.filename2 is not None else str(error.filename)
        return f"{files}: {error.strerror or error}"
    if isinstance(error, (ValueError, OSError)):  # RunnerError, RecordsUnreadable, HistoryError... name their file
        return str(error)
    return f"{type(error).__name__}: {error} (--debug shows the traceback)"


class _ReaderSafe:
    """stdout whose reader may leave early (`benchlib compare A B | head -1`): what follows is dropped, so
    the command still finishes and exits with its own status instead of failing on a broken pipe."""

    def __init__(self, stream):
        self._stream, self._gone = stream, False

    def _reader_left(self) -> None:
        self._gone = True
        try:  # later flushes, the interpreter's last one included, go nowhere instead of failing again
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `benchlib` command; returns the exit status (docs/setup.md, "Exit status"): an
    error ends as one line, `benchlib: error: ...`, and 2; its traceback only with --debug. Output to a
    reader that left early changes no exit status."""
    skip_iri_grammars()
    stdout = sys.stdout
    sys.stdout = _ReaderSafe(stdout)
    try:
        return _main(argv)
    finally:
        try:
            sys.stdout.flush()
        finally:
            sys.stdout = stdout


def _main(argv: Sequence[str] | None) -> int:
    arguments = _parser().parse_args(argv)
    arguments.argv = list(sys.argv[1:] if argv is None else argv)
    from benchlib.runner.interrupts import terminate_as_interrupt

    try:
        with terminate_as_interrupt():  # SIGTERM or SIGHUP at any point (planning too) ends like Ctrl-C
            return arguments.handler(arguments)
    except KeyboardInterrupt as stopped:
        from benchlib.runner.outcomes import EXIT_INTERRUPTED

        by = getattr(stopped, "signal_name", "")
        print(f"benchlib: {f'stopped by {by}' if by else 'interrupted'}; everything written so far is kept",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # every command's errors end here, so none prints a traceback without --debug
        if arguments.debug:
            _print_chain(error)
        print(f"benchlib: error: {one_line(error)}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
