"""The sparse GEMMs and the choice between them.

- :mod:`.packed`: the 2:4 packed format (values + metadata), on any device;
- :mod:`.inductor`: the ``nmsparse::sparse_linear`` op (cuSPARSELt, or the packed reference), weight
  compression, and the Inductor cache key;
- :mod:`.dispatch`: which kernel a layer may use (:func:`~.dispatch.qualify`) and whether it is
  faster than dense (:func:`~.dispatch.measure`; on a CPU :func:`.cpu_dispatch.measure_cpu`);
- :mod:`.cpu24`: the native 2:4 CPU kernel (C++ in ``cpu/``, built at first use), its layout and
  ``nmsparse::cpu24_*`` ops; :mod:`.packed_tensor`: a weight held packed only, on that kernel;
- :mod:`.training`: the 2:4 GEMMs inside training (``nmsparse::sparse24_mm``, compressing its operand
  at each call, and ``nmsparse::sparse_train_linear``, a linear whose forward, DGRAD and WGRAD each
  take a kernel; ``nmsparse::sparse_train_linear_gated``, the same for STEP's phase-gated forward,
  which CUDA graphs leave out);
- :mod:`.train_dispatch`: which kernel each training GEMM gets, timed against dense on CUDA;
- :mod:`.shared`: one compiled kernel shared by layers whose mask ops have the same signature.

Imported lazily where it needs Inductor; importing this folder's face loads nothing.
"""
