"""Benchmarks that are part of the product: the route-ahead band ablation (``bench-priority``,
:mod:`pdflash.bench.priority`) and the speculative-decoding benchmark (:mod:`pdflash.bench.speculative`)."""
