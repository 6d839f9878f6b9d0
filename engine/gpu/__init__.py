"""The GPU stage runner and the objects it owns (``runner.GpuRunner``): step buffers, expert
tables, use counters, the CPU's share, copies ahead, miss staging, the decode step's operations
(one CUDA graph) and the prompt chunk's (tensor cores, graphs around eager attention). Each
object is owned by one runner and never calls back into it. See docs/architecture.md."""
