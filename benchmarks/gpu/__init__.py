"""Benchmarks and checks on a CUDA GPU, and the scripts a lent GPU machine runs (see ../README.md)."""
