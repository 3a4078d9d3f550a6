"""Pieces benchmarks and notebooks share, apart from the benchmarks discovery imports: data sets
(`mnist_data`: MNIST with its real download, checks and visible fallback) and graph shapes for the
checkpointing planner (`graph_shapes`). Nothing here declares a benchmark."""
