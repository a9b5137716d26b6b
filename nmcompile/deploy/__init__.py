"""Deploying a trained model: bake the N:M weights (:func:`finalize`), verify them (:func:`check`,
:mod:`.inspection`), export them (:func:`export_onnx`, :mod:`.tensorrt`), merge LoRA adapters into them
with the pattern kept (:func:`merge_adapters`).

The user's one place for deployment: it also hands on what the saved directory stage
(:mod:`nmcompile.checkpoint`) does, :func:`save_pretrained`, :func:`load_pretrained`, :func:`restore`,
:func:`pack_weights`, and the packed format's :func:`pack_state_dict` (:mod:`nmcompile.kernels.format24`).

The compiled deploy graph itself is built by the ``nmsparse`` backend (``nmcompile.backends``) with
the kernels of :mod:`nmcompile.kernels`. ONNX and TensorRT load only when an export is asked for.
"""

from ..checkpoint import (Layout, PackedLinearWeight, layout_of, load_packed, load_pretrained, pack_weights,
                          read_layout, restore, save_pretrained, unpack_weights)
from ..kernels.format24 import Packed24, pack, pack_state_dict, unpack, unpack_state_dict
from .finalize import FinalizeReport, deploy_report, finalize
from .inspection import CheckReport, check, effective_weights
from .adapters import merge_adapters

__all__ = ["finalize", "FinalizeReport", "deploy_report", "check", "CheckReport", "effective_weights",
           "pack", "unpack", "pack_state_dict", "unpack_state_dict", "Packed24", "export_onnx",
           "pack_weights", "unpack_weights", "load_packed", "PackedLinearWeight",
           "save_pretrained", "load_pretrained", "restore", "Layout", "layout_of", "read_layout",
           "merge_adapters"]


def export_onnx(model, args, path, **kwargs):
    """ONNX export of a finalized model, verified N:M and checked against onnxruntime.

    See :func:`nmcompile.deploy.onnx.export_onnx` (imported on first use: ``onnx``,
    ``onnxscript`` and ``onnxruntime`` load only here).
    """
    from .onnx import export_onnx as _export

    return _export(model, args, path, **kwargs)
