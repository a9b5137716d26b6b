"""Weights sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): where nmcompile meets them.

FSDP2 keeps two parameter objects per weight: the sharded one (a ``DTensor``, split along dim 0,
what the module holds between forwards and what the optimizer updates) and the unsharded one (a
plain tensor that the module holds during its forward, so the compiled graph sees it). Recipe state
is kept whole on every rank (buffers are not sharded), so:

- :func:`nmcompile.annotate` computes state from :func:`full` weights (the recipe record belongs
  to the owning module, so both parameter objects FSDP2 swaps in and out carry it);
- mask math at optimizer time (mask refreshes, permutation searches, effective weights) runs on
  :func:`full` weights, identical on every rank;
- updates of the weight itself (STEP's frozen-moment step) run on :func:`local` shards, with the
  whole-state tensor cut to the rank's rows by :func:`shard_of`;
- statistics over all weights (STEP's ``Z_t``) are summed over ranks by :func:`sum_over_ranks`.

State never depends on the rank: it is computed from whole weights and, where random (Bi-Mask's
candidate row orders), from generators seeded by the optimizer step.

Nothing here imports ``torch.distributed`` unless a sharded weight is present.
"""

from __future__ import annotations

import torch

__all__ = ["is_sharded", "full", "local", "shard_of", "sum_over_ranks"]


def is_sharded(tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "device_mesh")


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a DTensor, the tensor itself otherwise)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local(tensor):
    """This rank's shard of a DTensor (a view: in-place updates reach the parameter), or the tensor."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def _dim0_placement(param) -> None:
    from torch.distributed.tensor import Shard

    placements = tuple(param.placements)
    if len(placements) != 1 or placements[0] != Shard(0):
        raise NotImplementedError(
            f"nmcompile handles weights sharded along dim 0 on a 1-D mesh (FSDP2's default), not placements "
            f"{placements}; use fully_shard without a custom shard_placement_fn for annotated weights"
        )


def shard_of(whole: torch.Tensor, param) -> torch.Tensor:
    """The rows of ``whole`` (shaped like the full ``param``) that this rank's shard of ``param`` holds."""
    if not is_sharded(param):
        return whole
    _dim0_placement(param)
    mesh = param.device_mesh
    chunks = torch.chunk(whole, mesh.size(), dim=0)  # FSDP2 shards with torch.chunk's split
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else whole[whole.shape[0]:]


def sum_over_ranks(values: torch.Tensor, params) -> torch.Tensor:
    """``values`` summed over the ranks that shard ``params`` (unchanged when nothing is sharded)."""
    sharded = next((p for p in params if is_sharded(p)), None)
    if sharded is None:
        return values
    import torch.distributed as dist

    out = values.clone()
    dist.all_reduce(out, group=sharded.device_mesh.get_group())
    return out
