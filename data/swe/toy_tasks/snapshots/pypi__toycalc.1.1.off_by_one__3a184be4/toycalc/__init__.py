"""toycalc: a tiny library that the SWE tests of k2jax break and fix (data/swe/toy/README.md)."""

__version__ = "1.1"
