"""The backend's Inductor plumbing: the decomposition table it hands Inductor and the compile-cache key.

:class:`CacheKeyPass` is a no-op post-grad pass whose ``uuid()`` hashes nmcompile's version, the
files that define its ops and passes, and the compile's plan (recipes, kernel decisions), so
Inductor's FX graph cache and AOTAutograd's cache never serve a graph built by other code.
:class:`Decompositions` is the table the backend hands Inductor, which pickles as what builds it:
Inductor pickles the table into its FX graph cache key, and a plain dict of Inductor's own table
holds functions that do not pickle, so every graph compiled with it bypassed the cache (a second
process compiled every 2:4 model anew).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import ops
from ..version import __version__
from .shared_projections import decompositions

__all__ = ["Decompositions", "CacheKeyPass", "ChainedPass", "with_cache_key"]


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class Decompositions(dict):
    """Inductor's decompositions, nmcompile's op bodies (:data:`nmcompile.ops.DECOMPOSITIONS`) and,
    where ``shared`` says, the shared projection kernels (:mod:`nmcompile.backends.shared_projections`): ``None``
    none, ``"all"`` every projection, or a tuple of the signatures (without strides) that share.

    It pickles as ``Decompositions(shared)``, so Inductor's cache key holds ``shared`` (its
    functions are torch's and nmcompile's code, which the key holds already: torch's version and
    :class:`CacheKeyPass`), and unpickling builds the same table."""

    def __init__(self, shared: str | tuple | None = None):
        from torch._inductor.compile_fx import select_decomp_table

        if not (shared is None or shared == "all" or isinstance(shared, tuple)):
            raise TypeError(f"Decompositions(shared): None, 'all' or a tuple of signatures, got {shared!r}")
        super().__init__({**select_decomp_table(), **ops.DECOMPOSITIONS})
        self.shared = shared
        if shared is not None:
            self.update(decompositions((lambda sig: True) if shared == "all" else shared.__contains__))

    def __reduce_ex__(self, protocol):
        return Decompositions, (self.shared,)


class CacheKeyPass(CustomGraphPass):
    """No-op post-grad pass whose ``uuid`` makes the compile caches specific to nmcompile's code and plan."""

    def __init__(self, plan: str):
        self.plan = plan

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        return hashlib.sha256(f"nmcompile {__version__}\n{_code_hash()}\n{self.plan}".encode()).hexdigest()


class ChainedPass(CustomGraphPass):
    """Several post-grad passes run in order as one, for torch releases whose
    ``post_grad_custom_post_pass`` takes a single pass (2.11 calls it; a list is accepted from 2.13)."""

    def __init__(self, passes):
        self.passes = tuple(passes)

    def __call__(self, graph) -> None:
        for run in self.passes:
            run(graph)

    def uuid(self) -> str:
        parts = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        if any(part is None for part in parts):  # a plain function has no key: Inductor must not cache
            return None
        return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def with_cache_key(patches: dict, plan: str) -> dict:
    """``patches`` with :class:`CacheKeyPass` run after any ``post_grad_custom_post_pass`` the user set
    (one :class:`ChainedPass`, which every supported torch release takes)."""
    key = "post_grad_custom_post_pass"
    current = patches.get(key, torch._inductor.config.post_grad_custom_post_pass)
    ours = CacheKeyPass(plan)
    if current is None:
        combined = ours
    elif isinstance(current, (list, tuple)):
        combined = ChainedPass([*current, ours])
    else:
        combined = ChainedPass([current, ours])
    return {**patches, key: combined}
