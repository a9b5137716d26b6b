"""Benchmarks of training steps: recipes against dense, compile time (see ../README.md)."""
