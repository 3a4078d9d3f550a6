"""Presentation: report.html (`page`), history.html (`history`), the plotly figure builders (`plots`), the
tables and text (`tables`), and figures as files in a run (`figure_files`). Takes tidy frames; measures
nothing and decides nothing. What a notebook shows besides its figures is re-exported here."""

from benchlib.report.figure_files import save_figure
from benchlib.report.tables.comparison import comparison_frame

__all__ = ["comparison_frame", "save_figure"]
