"""Benchmarks of the 2:4 CPU kernel (see ../README.md)."""
