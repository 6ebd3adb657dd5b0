"""Benchmarks that are part of the product: the route-ahead band ablation (``bench-priority``)."""
