"""The sparse GEMMs and the choice between them, one file or package per format, phase and device.

- :mod:`.names`: every kernel name the package accepts, in one table;
- :mod:`.format24`: the nibble format of 2:4 weights (values + 2-bit positions) that checkpoints, CUTLASS
  and the reference kernel use, on any device;
- :mod:`.cpu24`: the CPU kernel: its own layout (values + 16-bit position words), the native library (C++
  ``cpu24_*`` sources beside its ``__init__``, built at first use), its ``nmsparse::cpu24_*`` ops, and
  :class:`.cpu24.weight.PackedLinearWeight`, the tensor that holds a weight in that layout only;
- :mod:`.deploy_op`: ``nmsparse::sparse_linear``, the deploy op of a finalized layer (cuSPARSELt, the CPU
  kernel or the reference);
- :mod:`.train_gemms`: ``nmsparse::sparse24_mm`` and the training linears whose forward, input-gradient and
  weight-gradient products take 2:4 operands;
- :mod:`.dispatch`: which kernel each layer gets and why: the rules and cuSPARSELt's timing (its
  ``__init__``), the CPU kernel's timing (:mod:`.dispatch.cpu`) and its on-disk cache
  (:mod:`.dispatch.cache`), and the training GEMMs' choice (:mod:`.dispatch.train`).
"""
