"""The demo's readable outputs, built from a store: the per-token text report (text.py) and the
per-token loss/latency plot (plot.py)."""
