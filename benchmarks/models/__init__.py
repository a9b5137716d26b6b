"""Benchmarks on models of real size: making them, decoding, memory, checkpoints, one-shot pruning (see ../README.md)."""
