"""The saved model directory: the N:M layout record, save, load (dense or packed), streaming reads,
packed state dicts and weights, and the checks of files and directories.

- :mod:`.layout`: the record (``nmcompile.json``) of which weight is N:M along which dim;
- :mod:`.saving` / :mod:`.loading` / :mod:`.restore`: :func:`save_pretrained`, :func:`load_pretrained`,
  :func:`restore` (records back onto a model loaded some other way);
- :mod:`.packed_weights`: 2:4 weights held packed only on the CPU (:func:`pack_weights`, :func:`load_packed`);
- :mod:`.quantized_weights`: the int8 or 4-bit codes, positions and scales a directory holds for weights on
  recorded grids;
- :mod:`.streaming` / :mod:`.weight_files`: reading safetensors a run of rows at a time,
  weights files, and state dicts nested in checkpoints;
- :mod:`.file_checks`: N:M checks of files and directories, and what to check instead when one fails;
- :mod:`.folders`: an output folder written whole or not at all, never losing a file nmcompile did not write;
- :mod:`.conversions`: the weights transformers writes under other names and shapes (fused MoE experts,
  written one Linear weight per expert), and how they are built back.

Users reach these through :mod:`nmcompile.deploy`, which re-exports them.
"""

from .layout import Layout, layout_of, read_layout
from .loading import load_pretrained
from .packed_weights import PackedLinearWeight, load_packed, pack_weights, unpack_weights
from .restore import restore
from .saving import save_pretrained

__all__ = ["Layout", "layout_of", "read_layout", "load_pretrained", "PackedLinearWeight", "load_packed", "pack_weights",
           "unpack_weights", "restore", "save_pretrained"]
