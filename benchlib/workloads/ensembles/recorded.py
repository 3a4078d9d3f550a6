"""What mnist_ensembles' records hold beyond benchlib's shared metrics: its metrics, the kinds of variant
(strategies, LeNet5 modes, the GC measured alone, the FLOP floor) and their colours, declared with it."""

METRICS = (
    # per step and per cell
    ("step_time", "s", "time", "one training step (repeat = step index; warm-up steps included)"),
    ("step_gc_pauses", "count", "count", "GC collections that began in one step"),
    ("step_gc_time", "s", "time", "seconds of GC pauses in one step"),
    ("step_loss", "", "loss", "mean loss over the nets in one step"),
    ("step_time_median", "s", "time", "median step time after warm-up"),
    ("step_time_p99", "s", "time", "99th percentile step time after warm-up"),
    ("step_time_max", "s", "time", "slowest step after warm-up"),
    ("throughput", "model-samples/s", "rate", "samples times nets trained per second after warm-up"),
    ("gc_share", "", "ratio", "share of the timed seconds spent in GC pauses"),
    ("gc_pauses", "count", "count", "GC collections after warm-up"),
    ("step_gc_time_max", "s", "time", "longest GC time of one step after warm-up"),
    ("step_memory_max", "B", "memory", "highest memory in use after a step, after warm-up, above the cell's start"),
    ("cycle_bytes_max", "B", "memory", "most bytes uncollected reference cycles held after a step, after warm-up"),
    ("alloc_count_per_step", "count", "count", "allocations per step (a separate traced pass of several steps, less the "
     "tracker's floor, over its steps)"),
    ("alloc_bytes_per_step", "B", "memory", "bytes allocated per step (a separate traced pass)"),
    ("alloc_count_python_per_step", "count", "count", "Python-allocator allocations per step (the same traced pass, "
     "less the floor, over its steps)"),
    ("alloc_bytes_python_per_step", "B", "memory", "bytes of those Python-allocator allocations per step"),
    ("final_loss", "", "loss", "mean loss over the nets at the last step"),
    ("gc_pause_time", "s", "time", "one collection's pause (repeat = the pause's index in its cell or case)"),
    ("gc_pause_generation", "count", "count", "the generation one collection collected (repeat = pause index)"),
    ("gc_pause_collected", "count", "count", "unreachable objects one collection freed (repeat = pause index)"),
    ("gc_pause_uncollectable", "count", "count", "objects one collection found but could not free (repeat = pause index)"),
    ("gc_pause_tracked", "count", "count", "tracked objects one collection walked: its generation and the younger ones (repeat = pause index)"),
    ("gc_pause_step", "count", "count", "the training step in which one collection began (repeat = pause index)"),
    ("step_memory", "B", "memory", "memory in use after one step above the cell's start (RSS on CPU, allocated on CUDA; repeat = step index)"),
    ("step_cycle_bytes", "B", "memory", "bytes of step tensors held by reference cycles not yet collected, after one step (repeat = step index)"),
    # the rate the floor is computed at, recorded with it; calibration declares the same metric alike
    ("flop_rate", "FLOP/s", "rate", "matrix-product floating-point operations per second"),
    ("floor_step_s", "s", "time", "FLOP floor of one ensemble step at the measured FLOP rate"),
    ("ceiling_model_samples_per_s", "model-samples/s", "rate", "throughput ceiling at the measured FLOP rate"),
    # LeNet5 epochs
    ("epoch_time", "s", "time", "one epoch (repeat = epoch)"),
    ("epoch_gc_time", "s", "time", "seconds of GC pauses in one epoch"),
    ("epoch_gc_pauses", "count", "count", "GC collections in one epoch"),
    ("epoch_loss", "", "loss", "mean loss of the models over the epoch's last step"),
    ("epoch_alloc_count_est", "count", "count", "allocations per step (traced pass) times the epoch's steps"),
    ("epoch_alloc_bytes_est", "B", "memory", "bytes per step (traced pass) times the epoch's steps"),
    ("epoch_alloc_count_python_est", "count", "count", "Python-allocator allocations per step (traced pass) times the epoch's steps"),
)
DIMENSIONS = {
    "strategy": "a way to train the same ensemble",
    "mode": "a way to run the same models (LeNet5: sequential, threads, vmap)",
    "collector": "Python's garbage collector measured on its own",
    "bound": "a computed bound, not a run (the FLOP floor)",
}
COLORS = {  # strategies and LeNet5 modes never share a figure, but each name keeps one colour everywhere
    "naive": "#d62728",
    "buffers_reused": "#ff7f0e",
    "step_in_backward": "#9467bd",
    "batched_vmap": "#1f77b4",
    "batched_hand": "#2ca02c",
    "batched_fused": "#0f8b8d",
    "sequential": "#b2182b",
    "threads": "#e08214",
    "vmap": "#2166ac",
}
