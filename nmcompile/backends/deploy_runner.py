"""The ``nmsparse`` backend's deploy route: finalized models get fused 2:4 GEMMs.

Runs :data:`nmcompile.passes.DEPLOY_PASSES` (per-layer decision, then the rewrite to
``nmsparse::sparse_linear``), compiles the result, and returns a callable that appends each
sparse layer's compressed weight to the inputs. Weights are compressed when the graph is
compiled and again when a weight changes, or when another instance of the model class runs
through the same graph. A change is seen through the tensor's version counter (in-place writes:
``load_state_dict``, ``w.copy_`` under ``no_grad``), its data pointer (``w.data = t``,
``torch.nn.utils.vector_to_parameters``), and, for CPU weights, a sample of :data:`SAMPLED_ROWS`
rows (two positions each, spread over the rows and columns) compared at each call: a write through
``w.data`` counts no version (PyTorch gives ``.data`` a counter of its own), so ``w.data.copy_(t)``
is found by its values; one that changes none of the sampled positions is not seen. The sample is
small because it is read at every call of every layer: two positions of every row cost a
GPT-2-shaped decode (8 layers of width 1024, one token) 0.13-0.18 ms a layer, 8-9% of its time.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import fx

from ..kernels.dispatch import DECISION_ATTR
from ..kernels.deploy_op import compress

log = logging.getLogger("nmcompile")

__all__ = ["DeployRunner", "record_decisions"]


def record_decisions(ctx) -> None:
    """Put each layer's decision on its parameter (read by :func:`nmcompile.deploy_report`) and log it."""
    for target in ctx.deployed:
        setattr(target.param, DECISION_ATTR, target.decision)
        log.info("nmsparse deploy: %s -> %s", target.fqn, target.decision)


class DeployRunner:
    """Calls the compiled deploy graph with the compressed weights of the instance being run."""

    def __init__(self, gm: fx.GraphModule, ctx, compiled, n_inputs: int):
        placeholders = [node.name for node in gm.graph.find_nodes(op="placeholder")]
        self.compiled, self.n_inputs = compiled, n_inputs
        sparse = [t for t in ctx.deployed if t.decision.sparse]
        # per sparse weight: (its position among the inputs, kernel, decision, stored [in, out])
        self.layers = [(placeholders.index(t.node.name), t.decision.kernel, t.decision, t.transposed) for t in sparse]
        # id(weight) -> (weakref, (version, data pointer, sampled values), values, meta)
        self.cache: dict[int, tuple] = {}
        for t in sparse:  # compressed once by the rewrite pass
            values, meta = ctx.compressed[t.fqn]
            self.cache[id(t.param)] = (weakref.ref(t.param), _stamp(t.param), values, meta)

    def _packed(self, weight: torch.Tensor, kernel: str, decision, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self.cache.get(id(weight))
        if hit is not None and hit[0]() is weight and _same(hit[1], weight):
            return hit[2], hit[3]
        if hit is not None and hit[0]() is weight:
            log.warning("nmsparse deploy: a finalized weight %s changed; compressing it again", tuple(weight.shape))
        values, meta = compress(weight.t() if transposed else weight, kernel)  # raises if no longer 2:4
        self.cache[id(weight)] = (weakref.ref(weight), _stamp(weight), values, meta)
        if getattr(weight, DECISION_ATTR, None) is None:
            setattr(weight, DECISION_ATTR, decision)
        return values, meta

    def __call__(self, *args):
        inputs = list(args)
        for index, kernel, decision, transposed in self.layers:
            inputs.extend(self._packed(args[index], kernel, decision, transposed))
        return self.compiled(*inputs)


#: rows of a CPU weight whose values are compared at each call (two positions each)
SAMPLED_ROWS = 16


def _sample_index(weight: torch.Tensor) -> torch.Tensor | None:
    """Flat (row-major) indices of two positions in each of :data:`SAMPLED_ROWS` rows of ``weight``
    spread over its rows (every row of a smaller weight), the positions spread over its columns; None
    off the CPU (reading them back would wait for the device at every call)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not weight.numel() or not torch._C._has_storage(weight):
        return None  # (a tensor subclass without storage, e.g. a sharded one, is followed by its version only)
    rows, cols = weight.shape
    row = torch.linspace(0, rows - 1, min(rows, SAMPLED_ROWS)).round().to(torch.int64)
    first = (row * 7919 + 13) % cols
    return torch.cat([row * cols + first, row * cols + (first + cols // 2) % cols])


def _stamp(weight: torch.Tensor) -> tuple:
    """What :func:`_same` compares: the version counter, the data pointer and the sampled values."""
    index = _sample_index(weight)
    sample = None if index is None else torch.take(weight.detach(), index)
    return weight._version, _pointer(weight), index, sample


def _pointer(weight: torch.Tensor) -> int | None:
    return weight.data_ptr() if torch._C._has_storage(weight) else None


def _same(stamp: tuple, weight: torch.Tensor) -> bool:
    """Whether ``weight`` is unchanged since :func:`_stamp` (see the module's doc for what is seen)."""
    version, pointer, index, sample = stamp
    if weight._version != version or _pointer(weight) != pointer:
        return False
    return index is None or torch.equal(torch.take(weight.detach(), index), sample)
