"""Presentation: report.html (`page`), history.html (`history`), the plotly figure builders (`plots`) and
the tables and text (`tables`). Takes tidy frames; measures nothing and decides nothing."""
