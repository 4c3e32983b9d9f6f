"""Experiments run on top of ``classify``: benchmarks and the studies behind the defaults.

Run them from the repository root as modules, e.g. ``python -m experiments.bench --quick``.
"""
