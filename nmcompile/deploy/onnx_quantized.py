"""2:4 weights with int8 or 4-bit values in an exported ONNX file: codes initializers dequantized in the graph.

A finalized weight on a recorded grid (a one-shot solve with ``bits=8`` or ``bits=4``, or a model unpacked from
such values) is exported by :func:`nmcompile.deploy.export_onnx` as its codes and scales, turned back into the
weight in front of its consumers by nodes whose output keeps the weight's name ``W`` (then a ``Cast`` to the
weight's dtype where that is not float32):

- int8: ``<W>_int8`` (int8, the float initializer's shape) and ``<W>_scale`` (fp32, one per output channel),
  ``DequantizeLinear(codes, scale, axis=<output channel>)``: the Q/DQ form TensorRT reads for int8 weights.
- 4-bit, in a file of opset 21 or later (``export_onnx`` asks the exporter for 21 where the model holds 4-bit
  grids and no opset is given): ``<W>_int4`` (ONNX's INT4, two codes a byte) and ``<W>_scale`` (fp32, one per
  output channel and block of ``group`` positions along the reduction axis), ``DequantizeLinear(codes, scale,
  axis=<reduction axis>, block_size=group)``, ONNX's blocked quantization.
- 4-bit, in a file of an older opset (``opset=`` below 21, whose DequantizeLinear has no blocks): the codes stored
  as int8 ``<W>_int4`` with the reduction axis split into ``[blocks, group]``, ``Cast``, ``Mul`` by the scales
  ``[.., blocks, 1, ..]`` and ``Reshape`` back: the same weight, 8 bits a code on disk.

The record (``nmcompile.sparsity``) names the codes initializer, with ``"bits"`` and its scale (and ``"group"``
for 4-bit), so :func:`nmcompile.deploy.check_onnx` checks that the codes are N:M and on their grid and that the
scales are there.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.cpu24.quantize import HIGH4, LOW4, grid_codes

__all__ = ["quantize_initializers", "codes_problem", "codes_matrix", "BLOCKED_OPSET"]

#: the first opset whose DequantizeLinear takes INT4 codes with block scales
BLOCKED_OPSET = 21


def _codes4(values: torch.Tensor, scales: torch.Tensor, axis: int) -> tuple[torch.Tensor, int]:
    """``(int8 codes -8..7, values off the grid)`` of a 2-D ``values`` on the block ``scales`` (blocks along
    ``axis``); a value in a block of scale 0 is off unless it is 0."""
    d = scales.float().repeat_interleave(values.shape[axis] // scales.shape[axis], dim=axis)
    steps = values / torch.where(d != 0, d, 1.0)
    codes = torch.where(d != 0, torch.round(steps), 0.0)
    off = ((steps - codes).abs() > 0.3) | (codes < LOW4) | (codes > HIGH4) | ((d == 0) & (values != 0))
    return codes.clamp_(LOW4, HIGH4).to(torch.int8), int(off.sum())


def quantize_initializers(proto, entries: dict[str, dict], grids: dict[str, tuple[int, torch.Tensor]]) -> None:
    """Replace, in ``proto``, each recorded initializer whose parameter has a grid in ``grids`` (``{parameter:
    (8, fp32 scales [out]) or (4, scales [out, in/group])}``) by its codes and scales and the nodes that
    dequantize them; ``entries`` (``{initializer: record entry}``) is updated to name the codes initializers.
    ValueError naming a weight that is off its grid."""
    from onnx import TensorProto, helper, numpy_helper

    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    inits = {init.name: init for init in graph.initializer}
    nodes, updated = [], {}
    for name, entry in entries.items():
        bits, scales = grids.get(entry["parameter"], (None, None))
        if scales is None:
            updated[name] = entry
            continue
        init = inits[name]
        values = torch.from_numpy(numpy_helper.to_array(init).astype("float32"))
        axis = int(entry["axis"])  # the reduction axis; an int8 scale goes along the other
        blocks = scales.float() if bits == 8 or axis == 1 else scales.float().t()  # rows' scales -> the file's
        fits = blocks.shape == (values.shape[1 - axis],) if bits == 8 else \
            (values.dim() == 2 and blocks.shape[1 - axis] == values.shape[1 - axis] and blocks.shape[axis] > 0
             and values.shape[axis] % blocks.shape[axis] == 0)
        if values.dim() != 2 or not fits:
            raise ValueError(f"export_onnx: {entry['parameter']} is exported as {list(values.shape)} and has "
                             f"{list(scales.shape)} {bits}-bit scales, which do not fit it (reduction axis {axis})")
        if bits == 8:
            codes, off = grid_codes(values, blocks.reshape([-1, 1] if axis == 1 else [1, -1]))
        else:
            codes, off = _codes4(values, blocks, axis)
        if off:
            raise ValueError(
                f"export_onnx: {off} values of {entry['parameter']} are not on the {'int8' if bits == 8 else '4-bit'} "
                f"grid recorded for it (the weight changed after it was solved or packed with bits={bits}); prune it "
                f"again with bits={bits}, or pack_weights(model, bits={bits}) and unpack_weights(model) to record a "
                "new grid")
        q_name, s_name = f"{name}_int{bits}", f"{name}_scale"
        floating = init.data_type == TensorProto.FLOAT
        out = name if floating else f"{name}_float32"
        extra = {"scale": s_name}
        if bits == 8:
            graph.initializer.append(numpy_helper.from_array(codes.numpy(), q_name))
            graph.initializer.append(numpy_helper.from_array(blocks.numpy(), s_name))
            nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [out], name=f"{name}_dequantize",
                                          axis=1 - axis))
        else:
            group = values.shape[axis] // blocks.shape[axis]
            extra["group"] = group
            if opset >= BLOCKED_OPSET:
                import ml_dtypes

                graph.initializer.append(numpy_helper.from_array(codes.numpy().astype(ml_dtypes.int4), q_name))
                graph.initializer.append(numpy_helper.from_array(blocks.numpy(), s_name))
                nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [out],
                                              name=f"{name}_dequantize", axis=axis, block_size=group))
            else:  # int8 storage: [.., blocks, group, ..] times [.., blocks, 1, ..], reshaped back
                split = list(values.shape)
                split[axis:axis + 1] = [blocks.shape[axis], group]
                graph.initializer.append(numpy_helper.from_array(codes.reshape(split).numpy(), q_name))
                graph.initializer.append(numpy_helper.from_array(blocks.unsqueeze(axis + 1).numpy(), s_name))
                graph.initializer.append(numpy_helper.from_array(np.array(values.shape, dtype=np.int64),
                                                                 f"{name}_shape"))
                nodes += [helper.make_node("Cast", [q_name], [f"{name}_codes"], name=f"{name}_codes", to=TensorProto.FLOAT),
                          helper.make_node("Mul", [f"{name}_codes", s_name], [f"{name}_blocks"], name=f"{name}_scale"),
                          helper.make_node("Reshape", [f"{name}_blocks", f"{name}_shape"], [out], name=f"{name}_reshape")]
        if not floating:
            nodes.append(helper.make_node("Cast", [out], [name], name=f"{name}_cast", to=init.data_type))
        graph.initializer.remove(init)
        for held in [i for i in graph.input if i.name == name]:  # an older exporter lists initializers as inputs
            graph.input.remove(held)
        updated[q_name] = {**entry, "bits": bits, **extra}
    for node in reversed(nodes):  # they read initializers only: first in the graph
        graph.node.insert(0, node)
    entries.clear()
    entries.update(updated)


def codes_matrix(entry: dict, codes: np.ndarray) -> np.ndarray:
    """The 2-D codes of a recorded codes initializer (a 4-bit one stored as int8 has its reduction axis split in
    two: merged back)."""
    if codes.ndim == 3:
        axis = int(entry["axis"])
        shape = list(codes.shape)
        shape[axis:axis + 2] = [shape[axis] * shape[axis + 1]]
        return codes.reshape(shape)
    return codes


def codes_problem(entry: dict, codes: np.ndarray, inits: dict) -> str:
    """What is wrong with a recorded codes initializer (``codes``, a numpy array as stored) and its scale, or
    ``""``."""
    from onnx import numpy_helper

    bits = entry.get("bits")
    kinds = ("int8",) if bits == 8 else ("int4", "int8")
    if codes.dtype.name not in kinds:
        return f"recorded with {bits}-bit values but holds {codes.dtype.name}"
    matrix = codes_matrix(entry, codes).astype(np.int32)
    low, high = (-127, 127) if bits == 8 else (LOW4, HIGH4)
    if matrix.ndim != 2 or (matrix < low).any() or (matrix > high).any():
        return f"holds codes outside the grid {low}..{high} (or is not a matrix)"
    scale = inits.get(entry.get("scale", ""))
    if scale is None:
        return f"its scale initializer {entry.get('scale')!r} is missing"
    scale = numpy_helper.to_array(scale)
    axis = int(entry["axis"])
    if bits == 8:
        if scale.shape != (matrix.shape[1 - axis],) or not (scale > 0).all():
            return f"its scale initializer is {list(scale.shape)}, not {matrix.shape[1 - axis]} positive scales"
        return ""
    group = int(entry.get("group") or 0)
    want = list(matrix.shape)
    want[axis] = matrix.shape[axis] // group if group and matrix.shape[axis] % group == 0 else -1
    if scale.ndim == 3 and scale.shape[axis + 1] == 1:  # stored as int8: [.., blocks, 1, ..]
        scale = scale.reshape([n for i, n in enumerate(scale.shape) if i != axis + 1])
    if scale.shape != tuple(want) or not np.isfinite(scale).all():
        return f"its scale initializer is {list(scale.shape)}, not {want} finite scales (blocks of {group})"
    return ""
