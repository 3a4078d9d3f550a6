"""Plotly figure builders: take tidy DataFrames, return figures."""
