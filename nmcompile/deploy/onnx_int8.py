"""2:4 weights with int8 values in an exported ONNX file: int8 initializers dequantized per output channel.

A finalized weight on a recorded int8 grid (a one-shot solve with ``bits=8``, or a model unpacked from int8)
is exported by :func:`nmcompile.deploy.export_onnx` as its codes, an int8 initializer of the float one's shape
(``<W>_int8``), and one fp32 scale per output channel (``<W>_scale``), turned back into the weight in front of
its consumers by ``DequantizeLinear(codes, scale, axis=<output channel>)`` (then a ``Cast`` to the weight's
dtype where that is not float32), whose output keeps the name ``W``: the Q/DQ form TensorRT reads for int8
weights, with its 2:4 kernels, and that onnxruntime runs on any provider. The record (``nmcompile.sparsity``)
names the int8 initializer, with ``"bits": 8`` and its scale, so :func:`nmcompile.deploy.check_onnx` checks that
the codes are N:M and within -127..127 and that their scales are there.
"""

from __future__ import annotations

import torch

from ..kernels.cpu24.quantize import grid_codes

__all__ = ["quantize_initializers", "int8_problem"]


def quantize_initializers(proto, entries: dict[str, dict], grids: dict[str, torch.Tensor]) -> None:
    """Replace, in ``proto``, each recorded initializer whose parameter has a grid in ``grids`` (``{parameter:
    fp32 scales [out]}``) by its int8 codes and scales and a DequantizeLinear; ``entries`` (``{initializer:
    record entry}``) is updated to name the int8 initializers. ValueError naming a weight that is off its grid."""
    from onnx import TensorProto, helper, numpy_helper

    graph = proto.graph
    inits = {init.name: init for init in graph.initializer}
    nodes, updated = [], {}
    for name, entry in entries.items():
        scales = grids.get(entry["parameter"])
        if scales is None:
            updated[name] = entry
            continue
        init = inits[name]
        values = torch.from_numpy(numpy_helper.to_array(init).astype("float32"))
        channel = 1 - int(entry["axis"])  # the reduction axis is the recorded one; scales go along the other
        if values.dim() != 2 or values.shape[channel] != scales.numel():
            raise ValueError(f"export_onnx: {entry['parameter']} is exported as {list(values.shape)} and has "
                             f"{scales.numel()} int8 scales, which do not go along axis {channel}")
        shape = [1, 1]
        shape[channel] = -1
        codes, off = grid_codes(values, scales.float().reshape(shape))
        if off:
            raise ValueError(
                f"export_onnx: {off} values of {entry['parameter']} are not on the int8 grid recorded for it "
                "(the weight changed after it was solved or packed with bits=8); prune it again with bits=8, or "
                "pack_weights(model, bits=8) and unpack_weights(model) to record a new grid")
        q_name, s_name = f"{name}_int8", f"{name}_scale"
        graph.initializer.append(numpy_helper.from_array(codes.numpy(), q_name))
        graph.initializer.append(numpy_helper.from_array(scales.float().numpy(), s_name))
        floating = init.data_type == TensorProto.FLOAT
        out = name if floating else f"{name}_float32"
        nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [out], name=f"{name}_dequantize",
                                      axis=channel))
        if not floating:
            nodes.append(helper.make_node("Cast", [out], [name], name=f"{name}_cast", to=init.data_type))
        graph.initializer.remove(init)
        for held in [i for i in graph.input if i.name == name]:  # an older exporter lists initializers as inputs
            graph.input.remove(held)
        updated[q_name] = {**entry, "bits": 8, "scale": s_name}
    for node in reversed(nodes):  # they read initializers only: first in the graph
        graph.node.insert(0, node)
    entries.clear()
    entries.update(updated)


def int8_problem(entry: dict, codes, inits: dict) -> str:
    """What is wrong with a recorded int8 initializer (``codes``, a numpy array) and its scale, or ``""``."""
    from onnx import numpy_helper

    if codes.dtype.name != "int8":
        return f"recorded with int8 values but holds {codes.dtype.name}"
    if (codes == -128).any():
        return "holds the code -128, outside the symmetric grid -127..127"
    scale = inits.get(entry.get("scale", ""))
    channel = 1 - int(entry["axis"])
    if scale is None:
        return f"its scale initializer {entry.get('scale')!r} is missing"
    scale = numpy_helper.to_array(scale)
    if scale.shape != (codes.shape[channel],) or not (scale > 0).all():
        return f"its scale initializer is {list(scale.shape)}, not {codes.shape[channel]} positive scales"
    return ""
