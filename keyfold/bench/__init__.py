"""Benchmarks: each writes markdown, JSON and a plot under ``benchmarks/results/``.

They report ratios against a peer measured in the same run; no test asserts a time.
"""
