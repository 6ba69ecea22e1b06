"""The benchmarks, run from the repository root as `python -m bench.NAME` (bench/harness.py is the one
harness they share: interleaved rounds, wall and CPU time, ratios with a confidence interval, JSON)."""
