"""One module (or package) per benchmark: its declaration (`BENCHMARK`, a `benchlib.Benchmark`), the
workload for each engine, its cases and its checks. `benchlib.registry` lists the built-ins."""
