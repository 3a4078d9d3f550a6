"""A figure as files in a run directory: `figures/<name>.html` (opens offline, plotly.js shared once per run
and linked across runs), `figures/<name>.json` to reload it, and, under `benchlib run --png`, a PNG made
through kaleido. What plotly and kaleido need stays here, out of the records layer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benchlib.errors import Failed
from benchlib.records.store import FIGURES, file_name, write_atomic, write_text_atomic

FIGURE_PNG_ENV = "BENCHLIB_FIGURE_PNG"  # "1": save_figure also writes figures/<name>.png (benchlib run --png)


def save_figure(run: Any, fig: Any, name: str) -> Path:
    """`fig` (a plotly figure) as `figures/<name>.html` and `.json` in `run`'s directory (a `records.Run`);
    returns the HTML file's path."""
    file_name(name, "figure")
    figures = Path(run.path) / FIGURES
    figures.mkdir(parents=True, exist_ok=True)
    bundle = figures / "plotly.min.js"
    if not bundle.exists():
        _link_plotly_bundle(bundle, Path(run.path).parent)
    write_text_atomic(fig.to_json(), figures / f"{name}.json")
    if os.environ.get(FIGURE_PNG_ENV) == "1":
        write_atomic(figures / f"{name}.png",
                     lambda temp: fig.write_image(temp, format="png", width=1200, height=fig.layout.height or 500))
    return write_text_atomic(fig.to_html(include_plotlyjs="directory", full_html=True), figures / f"{name}.html")


def _link_plotly_bundle(bundle: Path, root: Path) -> None:
    """`bundle` as a hard link to an identical plotly.js in another run beside this one (4.8 MB a run
    otherwise): each run's figures still open on their own, moved or zipped, and deleting one run
    frees nothing another needs, but the disk holds one copy. A copy is written where no run beside
    has the same plotly.js or a link cannot be made (another file system)."""
    from plotly.offline import get_plotlyjs

    script = get_plotlyjs().encode("utf-8")
    temporary = bundle.with_name(f".{bundle.name}.{os.getpid()}")
    for other in root.glob(f"*/{FIGURES}/{bundle.name}"):
        try:  # only a file of this user's: no one else's rewrite of it may reach these figures
            facts = other.stat()
            if facts.st_uid != os.getuid() or facts.st_size != len(script) or other.read_bytes() != script:
                continue
            os.link(other, temporary)
            os.replace(temporary, bundle)
            return
        except OSError:
            temporary.unlink(missing_ok=True)
    write_atomic(bundle, lambda path: Path(path).write_bytes(script))


def check_static_export() -> None:
    """Refuse static (PNG) figure export where it cannot work: plotly exports through kaleido,
    which drives a Chrome or Chromium; one tiny export proves both are there."""
    try:
        import kaleido  # noqa: F401  (plotly imports it itself; here only to name what is missing)
    except ImportError:
        raise Failed("PNG export needs kaleido: pip install -e '.[png]' (and a Chrome or Chromium, "
                     "e.g. Debian's chromium package)") from None
    import plotly.graph_objects as go

    try:
        go.Figure().to_image(format="png", width=10, height=10)
    except Exception as error:  # kaleido says why (no browser found, browser failed to start)
        raise Failed(f"PNG export is not available here: kaleido could not drive a Chrome/Chromium "
                     f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                     "install one (Debian: apt-get install chromium) or run without --png") from None
