"""Every kernel name nmcompile accepts, in one table.

- :data:`DEPLOY_KERNELS`: what ``nmsparse::sparse_linear`` runs (:mod:`.deploy_op`) for a finalized 2:4 layer;
- :data:`TRAIN_KERNELS`: what ``nmsparse::sparse24_mm`` runs (:mod:`.train_gemms`) for a 2:4 training GEMM;
- :data:`DEPLOY_CHOICES` / :data:`TRAIN_CHOICES`: what the backend's ``deploy_kernel`` / ``train_kernel``
  options take: ``auto`` (measured per layer, :mod:`.dispatch`), ``dense``, or one of the kernels.
"""

__all__ = ["DEPLOY_KERNELS", "TRAIN_KERNELS", "DEPLOY_CHOICES", "TRAIN_CHOICES"]

DEPLOY_KERNELS = ("cusparselt", "cpu24", "reference")
TRAIN_KERNELS = ("cusparselt", "cutlass", "reference")
DEPLOY_CHOICES = ("auto", "dense", *DEPLOY_KERNELS)
TRAIN_CHOICES = ("auto", "dense", *TRAIN_KERNELS)
