"""Presentation: report.html (`page`), history.html (`history`), the plotly figure builders (`plots`), the
tables and text (`tables`), and figures as files in a run (`figure_files`). Takes tidy frames; measures
nothing and decides nothing. What a notebook shows besides its figures is re-exported here, imported when
first asked for: a process that needs one part (the palette, a table) loads none of the figures."""

from benchlib.lazy_exports import lazy_exports

_HOMES = {"comparison_frame": "tables.engine_summary", "save_figure": "figure_files"}

__getattr__ = lazy_exports(__name__, _HOMES)

__all__ = sorted(_HOMES)
