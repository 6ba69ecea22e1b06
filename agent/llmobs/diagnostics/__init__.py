"""LLM diagnostics: token-loss anomaly detectors, their evidence, layer streams and root-cause attribution."""
