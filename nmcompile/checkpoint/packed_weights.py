"""Finalized 2:4 weights held packed only, on the CPU: no dense copy resident.

- :func:`pack_weights` turns each finalized 2:4 linear weight of a CPU model into a
  :class:`~nmcompile.kernels.cpu24.weight.PackedLinearWeight` (values + position bits, about 53%
  of the dense bytes in fp32 and 56% in bf16/fp16), with the token range where the 2:4 CPU kernel
  measured faster, on the layer's shape, than unpacking the weight for the call and taking the
  dense GEMM (which is what larger calls do);
- :func:`load_packed` loads a packed checkpoint (:func:`nmcompile.deploy.pack_state_dict`) into a
  model, meta-device built or not, without making any dense 2:4 weight;
- :func:`unpack_weights` gives the model its dense weights back (to train, or to export to ONNX).

``model.state_dict()`` then holds the packed tensors; :func:`nmcompile.deploy.pack_state_dict`
writes them as values + metadata without unpacking, so ``torch.load(weights_only=True)`` and
:func:`load_packed` read them back.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..kernels import cpu24
from ..kernels.dispatch import DECISION_ATTR, Decision
from ..kernels.format24 import (DAMAGED_HINT, META_SUFFIX, Packed24, packed_record, lost_metadata, pack, packed_dims,
                               unpack)
from ..kernels.cpu24.quantize import GROUP_SIZES, quantize_dense, quantize_dense4, to_codes
from ..kernels.cpu24.weight import PackedLinearWeight
from ..pattern import NMPattern
from ..state import records
from ..state.records import DEPLOYED, deployed_of, owners
from ..kernels.dispatch.ranges import RangeRule
from ..state.deployed import Deployed

__all__ = ["pack_weights", "unpack_weights", "load_packed", "PackedLinearWeight", "RangeRule"]


#: the attribute of a packed-only parameter that keeps whether the dense weight it replaced was
#: trainable, for :func:`unpack_weights` (the packed one never is: it takes no gradient)
TRAINABLE_ATTR = "_nmcompile_requires_grad"


def set_packed(module: nn.Module, pname: str, weight: PackedLinearWeight, decision: Decision, trainable: bool = True,
               places=()) -> None:
    """``module.pname`` (and each ``(_, holder, attr)`` of ``places``: a tied weight's holders, which keep one
    parameter object) becomes a parameter holding ``weight``."""
    param = nn.Parameter(weight, requires_grad=False)
    setattr(param, DECISION_ATTR, decision)
    setattr(param, TRAINABLE_ATTR, bool(trainable))
    module._parameters[pname] = param
    for _, holder, attr in places:
        holder._parameters[attr] = param


def is_trainable(param: torch.Tensor) -> bool:
    """Whether the dense weight ``param`` stands for is trainable (a packed one keeps it in :data:`TRAINABLE_ATTR`)."""
    return bool(getattr(param, TRAINABLE_ATTR, param.requires_grad))


#: what ``pack_weights(bits=...)`` takes: None keeps the weight's own dtype for the kept values
BITS = (None, 8, 4)
#: the reason of a weight packed with int8 values; its token range is the float kernel's on its shape
INT8_REASON = "packed only, int8 values (token range: the float kernel's on this shape)"
#: the same for 4-bit values
INT4_REASON = "packed only, 4-bit values (token range: the float kernel's on this shape)"


def _head_of(model: nn.Module, head: str | None) -> tuple[str, nn.Linear] | None:
    """``(name, module)`` of the output head ``pack_weights(bits=8, head=...)`` quantizes: ``"auto"``, a Hugging Face
    model's ``get_output_embeddings()`` (none for other models); a module's name; None: none."""
    if head is None:
        return None
    modules = dict(model.named_modules())
    if head == "auto":
        getter = getattr(model, "get_output_embeddings", None)
        found = getter() if callable(getter) else None
        if not isinstance(found, nn.Linear):
            return None
        return next(name for name, module in modules.items() if module is found), found
    module = modules.get(head)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"nmcompile.deploy.pack_weights: head={head!r} names "
                         f"{'no module' if module is None else 'a ' + type(module).__name__} of this model; name an "
                         "nn.Linear (the output head), or pass head=None to keep every dense weight as it is")
    return head, module


def _pack_head(model: nn.Module, name: str, module: nn.Linear, isa: str, bits: int | None = 8,
               group: int = 64) -> Decision:
    """The head's weight as dense int8 rows (:func:`~nmcompile.kernels.cpu24.quantize.quantize_dense`), or 4-bit
    ones in groups of ``group`` (``bits=4``: :func:`~nmcompile.kernels.cpu24.quantize.quantize_dense4`), run on
    ``isa``, in every module holding that parameter (a tied input embedding looks its rows up in the same table).
    ``bits=None``: as it is held already."""
    param = module.weight
    tied = [(name, holder, attr) for name, holder in model.named_modules(remove_duplicate=False)
            for attr, p in holder._parameters.items() if p is param]
    if isinstance(param, PackedLinearWeight):
        held = f"4-bit rows in groups of {param.group}" if param.int4 else "int8 rows"
        if bits is not None and held != ("int8 rows" if bits == 8 else f"4-bit rows in groups of {group}"):
            raise ValueError(f"nmcompile.deploy.pack_weights: the output head {name} holds {held}; head_bits={bits} "
                             "would round it a second time: call nmcompile.deploy.unpack_weights(model) first, or "
                             "pack with what it holds")
        decision = getattr(param, DECISION_ATTR, Decision("cpu24", held))
        if param.dense_rows and param.isa != isa:  # the other activations' route
            decision = dataclasses.replace(decision, isa=isa)
            set_packed(module, "weight", param._with(isa=isa), decision, is_trainable(param), tied)
        return decision
    why = None
    if param.device.type != "cpu" or param.dtype not in cpu24.DTYPES:
        why = f"a {param.dtype} weight on {param.device.type} (the kernel takes CPU fp32/bf16/fp16)"
    elif param.shape[1] % (group if bits == 4 else 16):
        why = f"in_features {param.shape[1]} is not a multiple of {f'group={group}' if bits == 4 else 16}"
    elif not cpu24.status().available:
        why = cpu24.status().reason
    if why is not None:
        return Decision("dense", f"output head kept dense: {why}")
    values, scales = quantize_dense4(param.detach(), group) if bits == 4 else quantize_dense(param.detach())
    tensor = PackedLinearWeight(values, None, tuple(param.shape), -1, isa, False, scales, param.dtype)
    kind = f"4-bit rows in groups of {group}" if bits == 4 else "int8 rows"
    decision = Decision("cpu24", f"output head as dense {kind} (every token count)", isa=tensor.isa)
    set_packed(module, "weight", tensor, decision, param.requires_grad, tied)
    return decision


def pack_weights(model: nn.Module, *, measure: bool = True, bits: int | None = None, group: int = 64,
                 head: str | None = "auto", head_bits: int | None = None,
                 activations: str | None = None) -> dict[str, Decision]:
    """Hold every finalized 2:4 linear weight of ``model`` packed only; ``{name: decision}`` of each.

    A weight is packed when its record (from :func:`nmcompile.finalize`) says 2:4 along its
    reduction dim, it is a 2-D CPU tensor in fp32/bf16/fp16 with a reduction dim divisible by 16,
    and the 2:4 CPU kernel runs here; the others stay dense, with the reason in the returned
    decision. ``measure``: time the kernel on each shape (once per shape) against unpacking the
    weight plus the dense GEMM, and keep it for the token counts where it won; larger calls unpack
    the weight for the call. Without ``measure`` the kernel takes every token count. Tied weights
    are packed once. Idempotent. A later conversion of the model to another of the kernel's dtypes
    (``model.to(torch.bfloat16)``) decides each range again for that dtype (:class:`RangeRule`).

    ``bits=8``: the kept values as int8 codes, one symmetric fp32 scale per output row (round to nearest;
    :mod:`nmcompile.kernels.cpu24.quantize`), about 5 bits a weight; the layer still computes in its dtype
    (activations and output), the products on the codes in fp32, each row's sum scaled once. Weights packed
    already are quantized where they hold float values; ``bits=None`` never dequantizes int8 ones
    (:func:`unpack_weights` does). Their token range is the float kernel's on the same shape, as
    :data:`INT8_REASON` says. To save a model holding int8 values, :func:`unpack_weights` it first (it records
    each grid) and call ``save_pretrained``: the directory holds the codes beside the dequantized weights.
    With ``bits=8`` the output head, the largest weight a decoded token reads, becomes dense int8 rows too
    (``nmsparse::cpu24_dense_q8``), and an input embedding tied to it looks its rows up in that table:
    ``head="auto"`` is a Hugging Face model's ``get_output_embeddings()``, a name picks a module, None keeps it.
    ``bits=None`` on a model a one-shot recipe with ``bits=8`` was solved for (``sparsegpt:2:4,bits=8``) means 8:
    those layers are held on the grid the solve recorded, with no second rounding.

    ``bits=4``: the kept values as 4-bit codes with an fp16 scale per row and ``group`` positions (64 or 128;
    round to nearest: 3.25 bits a weight at 64 with the positions), on the int8-activation route only (below;
    AVX2); a layer whose in_features is not a multiple of ``group`` keeps float values, its decision says so. The
    head becomes dense 4-bit rows in groups of ``group`` (4.25 bits a weight at 64), or int8 ones with
    ``head_bits=8`` (``head_bits``: the head's, default ``bits``). Weights that hold int8 values already are refused
    (:func:`unpack_weights` first: a second rounding from the int8 grid is not the 4-bit grid of the weight).

    ``activations``: what the quantized weights' products take their activations as. ``"float"`` (the default
    for ``bits=8``): the layer's dtype, widened to fp32. ``"int8"`` (the only route of ``bits=4``): each call
    quantizes its activations in blocks of 32 positions (a block's scale its largest magnitude / 127, round to
    nearest) and multiplies integers, the sums exact within a block (:data:`~nmcompile.kernels.cpu24.A8_ISA`,
    AVX2): on one token 2-2.5x the float route's speed, at the activations' rounding (a relative error of about
    0.5% of a layer's output; the quality study measures it on models). It applies to every int8 weight of the
    model, the head's too, and ``pack_weights(model, activations=...)`` switches a packed model's int8 weights
    either way; a NaN or infinite activation makes its token's outputs of the layer NaN.
    """
    if bits not in BITS:
        raise ValueError(f"nmcompile.deploy.pack_weights: bits={bits!r} is not supported; bits=8 holds the kept values "
                         "as int8 with a scale per row, bits=4 as 4-bit codes with a scale per row and group of "
                         "positions, bits=None (the default) in the weight's own dtype")
    if bits is None and any(records.get(p[0][1], records.INT8, p[0][2]) is not None for _, p in owners(model)):
        bits = 8  # a one-shot solve with bits=8 put weights on int8 grids: they are served as int8
    if bits is None and any(records.get(p[0][1], records.INT4, p[0][2]) is not None for _, p in owners(model)):
        bits = 4  # a one-shot solve with bits=4: served as 4-bit, on the grids (and groups) it recorded
    if bits == 4 and activations not in (None, "int8"):
        raise ValueError(f"nmcompile.deploy.pack_weights: bits=4 runs with int8 activations only, got "
                         f"activations={activations!r}; leave activations unset (or 'int8'), or take bits=8 for float "
                         "activations")
    if head_bits not in (None, 8, 4) or (head_bits == 4 and bits != 4) or (head_bits is not None and bits is None):
        raise ValueError(f"nmcompile.deploy.pack_weights: head_bits={head_bits!r} with bits={bits!r}: the head takes 8 "
                         "(int8 rows, with bits=8 or 4) or 4 (4-bit rows, with bits=4), or None (as bits)")
    if bits == 4 and group not in GROUP_SIZES:
        raise ValueError(f"nmcompile.deploy.pack_weights: group={group!r} is not supported; a 4-bit scale covers "
                         f"{' or '.join(map(str, GROUP_SIZES))} positions of a row")
    holds4 = any(isinstance(p, PackedLinearWeight) and p.int4 for p in model.parameters())
    if activations == "float" and holds4:
        raise ValueError("nmcompile.deploy.pack_weights: activations='float': this model holds 4-bit values, which "
                         "run with int8 activations only; nmcompile.deploy.unpack_weights(model) and pack_weights("
                         "model, bits=8) for float activations")
    isa8 = cpu24.int8_isa(activations or ("int8" if bits == 4 or holds4 else "float"))
    state = cpu24.status()
    rule_reason = {8: INT8_REASON, 4: INT4_REASON}.get(bits, "packed only")
    out: dict[str, Decision] = {}

    def grid_of(module, pname, in_features):
        """``(the grid a one-shot solve recorded or None, the weight's 4-bit group: the solve's, else group=)``."""
        grid = records.get(module, records.INT4 if bits == 4 else records.INT8, pname) if bits else None
        return grid, in_features // grid.shape[-1] if bits == 4 and grid is not None else group

    def hold(module, pname, tensor, reason, trainable, places, name):
        """``tensor`` as the layer's weight, its range decided (``reason``: the decision's, else from ``bits``);
        quantized first where ``bits`` asks."""
        reason = reason or rule_reason
        grid, own = grid_of(module, pname, tensor.weight_shape[1])
        if bits == 4 and tensor.weight_shape[1] % own:
            reason = f"packed only, float values: in_features {tensor.weight_shape[1]} is not a multiple of group={own}"
        elif bits in (8, 4) and not tensor.quantized:
            tensor, how = to_codes(tensor, bits, isa8, grid, own)
            reason = f"{rule_reason}; {how}"
        decision = RangeRule(isinstance(getattr(module, "bias", None), torch.Tensor), measure, reason).decide(tensor)
        set_packed(module, pname, tensor, decision, trainable, places)
        out[name] = decision

    for name, places in owners(model):
        _, module, pname = places[0]
        param = module._parameters[pname]
        record = deployed_of(module, pname)
        if record is None:
            continue
        if isinstance(param, PackedLinearWeight):
            held = f"4-bit values in groups of {param.group}" if param.int4 else "int8 values" if param.quantized else ""
            own = grid_of(module, pname, param.weight_shape[1])[1]
            if held and bits in (8, 4) and held != ("int8 values" if bits == 8 else f"4-bit values in groups of {own}"):
                raise ValueError(f"nmcompile.deploy.pack_weights: {name} holds {held}; bits={bits} rounds float values "
                                 "(a second rounding from another grid is not the weight's own): call "
                                 "nmcompile.deploy.unpack_weights(model) first, or pack with what it holds")
            if param.quantized and not param.dense_rows and not param.int4 and param.isa != isa8:
                reason = getattr(param, DECISION_ATTR, Decision("cpu24", INT8_REASON)).reason  # the other route
                hold(module, pname, param._with(isa=isa8), reason, is_trainable(param), places, name)
            elif bits in (8, 4) and not param.quantized:
                hold(module, pname, param, "", is_trainable(param), places, name)
            else:
                out[name] = getattr(param, DECISION_ATTR, Decision("cpu24", "packed"))
            continue
        why = None
        if record.pattern != NMPattern(2, 4):
            why = f"{record.pattern} is not 2:4"
        elif param.dim() != 2 or record.dim not in (0, 1, -1, -2):
            why = f"a {param.dim()}-D weight (the 2:4 CPU kernel takes linear weights)"
        elif param.device.type != "cpu" or param.dtype not in cpu24.DTYPES:
            why = f"a {param.dtype} weight on {param.device.type} (the kernel takes CPU fp32/bf16/fp16)"
        elif not state.available:
            why = state.reason
        transposed = record.dim in (0, -2)  # [in, out] (GPT-2's Conv1D): packed as its transpose
        weight = param.detach().t() if transposed else param.detach()
        if why is None and weight.shape[1] % 16:
            why = f"in_features {weight.shape[1]} is not a multiple of 16"
        if why is not None:
            out[name] = Decision("dense", why)
            continue
        packed = pack(weight)
        values, kept_bits = cpu24.cpu_layout(packed.values, packed.meta)
        tensor = PackedLinearWeight(values, kept_bits, tuple(weight.shape), -1, cpu24.best_isa(weight.dtype), transposed)
        hold(module, pname, tensor, "", param.requires_grad, places, name)
    int8 = bits in (8, 4) or any(isinstance(p, PackedLinearWeight) and p.quantized for p in model.parameters())
    found = _head_of(model, head) if int8 else None
    if found is not None and out and (bits in (8, 4) or isinstance(found[1].weight, PackedLinearWeight)):
        out[f"{found[0]}.weight"] = _pack_head(model, *found, isa8, head_bits or bits, group)
    if activations == "int8" and not int8:
        raise ValueError("nmcompile.deploy.pack_weights: activations='int8' is the route of int8 weights, and "
                         f"{type(model).__name__} holds none; pass bits=8 to quantize its 2:4 weights")
    if not out:
        raise ValueError(
            f"nmcompile.deploy.pack_weights: {type(model).__name__} has no finalized weight; call "
            "nmcompile.finalize(model) first (or load_packed for a packed checkpoint)"
        )
    return out


def unpack_weights(model: nn.Module) -> list[str]:
    """Give every packed-only weight its dense parameter back (a new tensor each); the names. Each is
    trainable as the weight it replaced was (``requires_grad``: a model's own weights, a loaded
    checkpoint's too, are; one frozen before :func:`pack_weights` stays frozen). A 2:4 weight with int8
    values becomes its dequantized weight (code times scale), its grid recorded: ``save_pretrained`` writes
    its codes, and ``pack_weights`` holds it on the same grid again; one with 4-bit values likewise (its group
    scales recorded)."""
    done = []
    for name, places in owners(model):
        param = places[0][1]._parameters[places[0][2]]
        if isinstance(param, PackedLinearWeight):
            dense = nn.Parameter(param.dense().contiguous(), requires_grad=getattr(param, TRAINABLE_ATTR, True))
            for _, holder, attr in places:
                holder._parameters[attr] = dense
                if param.quantized and not param.dense_rows:  # its grid, for a save or pack_weights
                    key, grid = _grid_record(param)
                    records.put(holder, key, attr, grid)
            done.append(name)
    return done


def _grid_record(param: PackedLinearWeight) -> tuple:
    """``(record key, scales)`` of a packed weight's grid: int8 row scales, or 4-bit ones ``[out, in/group]``."""
    if not param.int4:
        return records.INT8, param.scales.clone()
    scales = param.scales.transpose(1, 2).reshape(-1, param.scales.shape[1])[:param.weight_shape[0]]
    return records.INT4, scales.contiguous()


def load_packed(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True):
    """Load a state dict written by :func:`nmcompile.deploy.pack_state_dict` into ``model``, its
    packed 2:4 weights as packed-only parameters (no dense weight is made) and recorded as
    finalized 2:4 along ``in``; every other entry as ``load_state_dict(assign=True)`` does, so a
    model built on the meta device works. Returns ``load_state_dict``'s result.

    A packed entry must belong to a weight of the same shape (``[out, in]``, the values
    ``[out, in/2]``; an entry packed as its transpose, GPT-2's ``Conv1D``, a weight ``[in, out]``,
    recorded 2:4 along dim 0). Those the kernel does not take (a mixture of experts' 3-D
    ``[experts, out, in]`` weights, a float64 model) are loaded dense, recorded 2:4 along their last
    dim, with a warning naming them. A packed weight's token range is every count (call :func:`pack_weights` with ``measure``
    after :func:`unpack_weights` to time it, or compile with the ``nmsparse`` backend).
    """
    if not cpu24.status().available:
        raise RuntimeError(f"load_packed needs the 2:4 CPU kernel, which is not available here: "
                           f"{cpu24.status().reason}; load nmcompile.deploy.unpack_state_dict(state) instead")
    modules = dict(model.named_modules())
    lost = lost_metadata(state)
    lost += [key for key in _half_width(state, modules) if key not in lost]
    if lost:
        raise ValueError(
            f"load_packed: the file is damaged: {', '.join(lost)} {'was' if len(lost) == 1 else 'were'} written packed "
            f"but {'its' if len(lost) == 1 else 'their'} {META_SUFFIX} entry is missing; write the checkpoint again "
            "with nmcompile.deploy.pack_state_dict" + ("" if packed_record(state) is not None else DAMAGED_HINT)
        )
    plain, dims, held_dense = {}, packed_dims(state), []
    for key, tensor in state.items():
        if key.endswith(META_SUFFIX):
            if key[: -len(META_SUFFIX)] not in state:
                raise ValueError(f"load_packed: {key} has no values entry {key[: -len(META_SUFFIX)]!r}; the file is damaged")
            continue
        meta = state.get(key + META_SUFFIX)
        if meta is None:
            plain[key] = tensor
            continue
        mname, _, pname = key.rpartition(".")
        module = modules.get(mname)
        param = None if module is None else module._parameters.get(pname)
        transposed = dims.get(key) == 0
        shape = (*tensor.shape[:-1], tensor.shape[-1] * 2)
        expected = shape[::-1] if transposed else shape
        if param is None or tuple(param.shape) != expected:
            layout = " (held as its transpose, GPT-2's Conv1D)" if transposed else ""
            raise ValueError(
                f"load_packed: {key} holds a packed 2:4 weight of shape {list(expected)}{layout}, but "
                f"the model's {key} is {None if param is None else list(param.shape)}"
            )
        dtype = tensor.dtype if param.is_meta else param.dtype
        why = (f"a {len(shape)}-D weight: the 2:4 CPU kernel takes 2-D linear weights" if len(shape) != 2 else
               None if dtype in cpu24.DTYPES else f"{dtype}: the 2:4 CPU kernel takes float32, bfloat16 and float16")
        if why is not None:  # e.g. a mixture of experts' [experts, out, in] weights: loaded dense, recorded 2:4
            dense = unpack(Packed24(tensor, meta))
            plain[key] = (dense.t() if transposed else dense).contiguous().to(dtype)
            held_dense.append(f"{key} ({why})")
            records.put(module, DEPLOYED, pname, _deployed(0 if transposed else -1 if len(shape) > 2 else 1))
            continue
        weight = PackedLinearWeight.from_packed(tensor, meta)
        weight = weight.to(dtype) if dtype != tensor.dtype else weight
        if transposed:
            weight = weight._with(transposed=True)
        set_packed(module, pname, weight, Decision("cpu24", "packed only, loaded (every token count, not timed)",
                                             isa=weight.isa), is_trainable(param))
        records.put(module, DEPLOYED, pname, _deployed(0 if transposed else 1))
    if held_dense:
        warnings.warn("nmcompile.deploy.load_packed: these 2:4 weights are loaded dense (recorded 2:4), the 2:4 CPU "
                      "kernel does not take them: " + ", ".join(held_dense), stacklevel=2)
    missing_packed = [k for k in model.state_dict() if k not in plain and k + META_SUFFIX not in state]
    result = model.load_state_dict(plain, strict=False, assign=True)
    if strict and (missing_packed or result.unexpected_keys):
        raise RuntimeError(f"load_packed: missing keys {missing_packed}, unexpected keys {result.unexpected_keys}")
    return result


def _half_width(state: Mapping, modules: dict) -> list[str]:
    """Entries without metadata, in a dict that holds packed ones, whose shape is that of the model's weight
    with half its last dim (or, 2-D, half its first: a transposed one): packed values that lost their metadata."""
    if not any(key.endswith(META_SUFFIX) for key in state):
        return []
    found = []
    for key, tensor in state.items():
        if key.endswith(META_SUFFIX) or key + META_SUFFIX in state or not isinstance(tensor, torch.Tensor):
            continue
        mname, _, pname = key.rpartition(".")
        param = getattr(modules.get(mname), "_parameters", {}).get(pname)
        if param is None or param.dim() < 2 or tensor.dim() != param.dim() or tensor.shape[-1] * 2 not in param.shape[-1:] + param.shape[:1]:
            continue
        shape = tuple(param.shape)
        if tuple(tensor.shape) in ((*shape[:-1], shape[-1] // 2), (shape[-1], shape[0] // 2) if len(shape) == 2 else ()):
            found.append(key)
    return found


def _deployed(dim: int = 1):
    return Deployed(NMPattern(2, 4), dim, "")
