"""Evaluation: per-exit-layer agreement, the perplexity gate, decoding benchmarks and reports."""
