"""The `benchlib` command: the parser its families of subcommands build (`benchlib.runner.commands`), the
dispatch to the one named, and every error ending as one line with its exit status (`benchlib.errors`; its traceback
with --debug). An error benchlib does not explain is a bug: "internal error", its traceback saved to a file."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence

from benchlib.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_REFUSED, BenchlibError
from benchlib.runner.commands import model_files, results, running
from benchlib.runner.startup import skip_iri_grammars

FAMILIES = (running, model_files, results)  # the subcommands' families, in the order --help lists them


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


def _print_chain(error: BaseException, file=None) -> None:
    """The error's traceback and those of the errors behind it, the original first (for --debug and bug reports)."""
    file = file or sys.stderr
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    for link in reversed(chain):
        traceback.print_exception(type(link), link, link.__traceback__, chain=False, file=file)
        if getattr(link, "child_traceback", ""):  # raised in a child process: where, in that child
            print(f"--- in the child process ---\n{link.child_traceback.rstrip()}", file=file)


def ending(error: BaseException, argv: Sequence[str] = ()) -> tuple[int, str]:
    """The exit status and the one line an error ends a command with: an error benchlib explains, its own message
    and status (a refusal says what is valid); an OS error, the file and what is wrong with it (2); anything else is
    a bug, "internal error", its traceback and the command line `argv` saved to a file the line names (1)."""
    if isinstance(error, BenchlibError) and getattr(error, "child_traceback", ""):  # the child's traceback: --debug
        return error.exit_status, f"error: {str(error).splitlines()[0]} (--debug shows the child's traceback)"
    if isinstance(error, BenchlibError):
        return error.exit_status, f"error: {error}"
    if isinstance(error, OSError) and error.filename is not None:
        files = f"{error.filename} -> {error.filename2}" if error.filename2 is not None else str(error.filename)
        return EXIT_REFUSED, f"error: {files}: {error.strerror or error}"
    if isinstance(error, OSError):  # a full disk, a closed pipe: what the system said
        return EXIT_REFUSED, f"error: {error}"
    return EXIT_FAILED, f"internal error: {type(error).__name__}: {error} (a bug in benchlib; {_saved_traceback(error, argv)})"


def _saved_traceback(error: BaseException, argv: Sequence[str]) -> str:
    """Where the bug's traceback was written, for its report, in words."""
    try:
        with tempfile.NamedTemporaryFile("w", prefix="benchlib-internal-error-", suffix=".txt", delete=False) as file:
            print(f"benchlib {' '.join(argv)}", file=file)
            _print_chain(error, file)
        return f"its traceback is in {file.name}; please attach it to a report"
    except OSError as unsaved:
        return f"its traceback could not be saved ({unsaved}); --debug prints it"


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
    error ends as one line, `benchlib: error: ...`, and the status it carries (`ending`); its traceback only with
    --debug. Output to a reader that left early changes no exit status."""
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
        by = getattr(stopped, "signal_name", "")
        print(f"benchlib: {f'stopped by {by}' if by else 'interrupted'}; everything written so far is kept",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # every command's errors end here, so none prints a traceback without --debug
        if arguments.debug:
            _print_chain(error)
        status, line = ending(error, arguments.argv)
        print(f"benchlib: {line}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
