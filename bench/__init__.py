"""Benchmarks of the engine: ratios against baselines measured in the same run.

Entry point: ``python -m bench.checkpoint`` (``make bench``). Not part of ``make test``: a
benchmark prints medians and percentiles on a shared, noisy machine; it asserts nothing.
"""
