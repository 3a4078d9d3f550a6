"""One module per benchmark: the workload for each engine, its cases and its checks."""
