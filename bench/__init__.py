"""``strata bench``: how fast a model runs on this machine, at which memory, against llama.cpp.

* ``settings``: what one run measures (budgets, sizes, reps), parsed and validated (no torch);
* ``stats``: summaries, rates from raw counts, the memory roofline, pairing (plain Python);
* ``probes``: peak RSS, VRAM through NVML, device-memory and PCIe bandwidths;
* ``strata_run``: Strata at each cache budget, and the resize test;
* ``llama``: ``llama-bench`` on the same file, one process per ``--n-cpu-moe``;
* ``session``: one run, start to end (``run_bench``);
* ``report``: tables and the optional plot.

The results are a JSON-ready dict that keeps every raw count and time the rates come from;
``docs/benchmarks.md`` describes its fields and holds the numbers measured so far.
"""
