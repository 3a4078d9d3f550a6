"""What benchlib's own processes (the command, the kernels it starts) do first, before their imports.

jsonschema, which nbformat imports (papermill in the command, plotly's notebook renderer in a kernel), checks
IRI formats with `rfc3987_syntax` when it is installed (jupyter-events asks for it), and that module builds its
Lark grammars at import: about 3 s of one core per process on a 2-core VM, in a run of three processes. Nothing
benchlib runs validates an IRI, so its own processes go without that checker; a user's own kernel is untouched.
"""

from __future__ import annotations

import sys

IRI_GRAMMARS = "rfc3987_syntax"


def skip_iri_grammars() -> None:
    """Make `import rfc3987_syntax` fail fast in this process (jsonschema then skips its IRI format checks),
    unless it is imported already."""
    sys.modules.setdefault(IRI_GRAMMARS, None)


# The same, as a line a kernel runs as it starts (`--IPKernelApp.exec_lines`), before any cell.
KERNEL_LINE = f"from {__name__} import skip_iri_grammars; skip_iri_grammars()"
