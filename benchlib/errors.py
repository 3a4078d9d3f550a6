"""The errors benchlib explains, each carrying the exit status a `benchlib` command ends with (docs/setup.md, "Exit
status"): a refusal of input (2), work that could not finish (1), an interruption (130). Any other exception that
reaches a command is a bug in benchlib: it ends as "internal error", its traceback saved to a file it names.

It imports nothing, so that every module may raise these before any library is loaded."""

EXIT_OK = 0
EXIT_FAILED = 1  # answered, and something failed or got worse; or work that could not finish
EXIT_REFUSED = 2  # could not answer: input refused before any work (the message says what is valid)
EXIT_INTERRUPTED = 130  # Ctrl-C, SIGTERM or SIGHUP, with everything written so far kept


class BenchlibError(Exception):
    """An error whose message is written for the user; `exit_status` is the status the command ends with."""

    exit_status = EXIT_FAILED


class Refused(BenchlibError, ValueError):
    """Input that cannot be taken as given (a name, a value, a file, a limit): refused before any work, saying what
    is valid. A ValueError, so callers of the library catch it as Python's convention has it."""

    exit_status = EXIT_REFUSED


class Failed(BenchlibError, RuntimeError):
    """Work that started and could not finish (a child process that died, every case failing), saying why."""

    exit_status = EXIT_FAILED
