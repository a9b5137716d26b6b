"""ASP's channel permutation: the search is mask math (:mod:`nmcompile.masks.permutation`); this
stage applies it to a model safely.

- :mod:`.channels`: :func:`~.channels.permute_channels`, moving producer/consumer channel groups;
- :mod:`.graph`: the producer/consumer groups read from an FX trace;
- :mod:`.checks`: what the trace cannot show (hooks, parametrizations, shared memory), refused;
- :mod:`.proof`: every permuted group checked numerically, and undone bit for bit on a mismatch.
"""
