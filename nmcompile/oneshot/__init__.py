"""One-shot pruning (Wanda, SparseGPT): calibrate the declared model, then solve each weight from the statistics.

- :mod:`.calibrate`: what :func:`nmcompile.finalize` calls: run the caller's calibration, choose one pass or
  the sequential form, and return ``{name: Solved}``;
- :mod:`.solve`: the solve itself, per weight, from the ``stat``/``count`` buffers the graphs gathered (one
  pass, or block by block re-running the model);
- :mod:`.sequential`: the sequential form on cached block inputs (about one forward in all);
- :mod:`.block_order`: the order a model runs its blocks in;
- :mod:`.compute_dtype`: the dtype calibration computes in, apart from the model's stored dtype.
"""
