"""Tables and text summaries of a benchmark's frames, beside the figure builders of `plots`.

A table builder takes tidy frames (records, or a workload's summary frame) and returns a DataFrame or
text; it derives medians, ratios and percentiles instead of reading them from stored metrics where
it can, and never measures anything.
"""
