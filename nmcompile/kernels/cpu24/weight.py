"""A 2:4 weight held packed only: a tensor subclass over the CPU kernel's layout, no dense copy.

:class:`PackedLinearWeight` stands where a finalized ``[out, in]`` linear weight was (the
parameter of its module, as FSDP2's DTensor does): it has the weight's shape and dtype but holds
only the kernel's ``values`` and position ``bits`` (:func:`nmcompile.kernels.cpu24.cpu_layout`,
53% of the dense bytes in fp32, 56% in bf16/fp16, plus at most 7 padding rows). What reads it:

- ``F.linear`` (eager, ``torch.compile``, ``torch.export``; under ``torch.no_grad`` or
  ``torch.inference_mode``, where ``F.linear`` and ``matmul`` arrive whole): the product ``x @ W.t()`` runs on
  ``nmsparse::cpu24_linear`` with the layer's measured range (``max_tokens``; calls above it take
  the dense GEMM on the weight unpacked for that call);
- any other op (``check``, arithmetic, printing): computed on the dense weight, unpacked for that
  call only;
- ``nmcompile.deploy.pack_state_dict`` writes its packed values and metadata without unpacking.

It is traceable (``__tensor_flatten__``): Dynamo, AOTAutograd and ``torch.export`` see the two
inner tensors. It stays packed through ``copy.deepcopy``, ``torch.save`` of a whole model (loading it
registers the kernel's ops), ``share_memory_`` (the values and bits move) and conversions to the
kernel's dtypes (``model.to(torch.bfloat16)``, which decide the token range again for the new dtype, see
:data:`RANGE_ATTR`; others, ``model.double()``, are refused). Read-only: in-place ops, ``.data`` assignment
and gradients are refused with what to do instead.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from .. import cpu24
from . import quantize

__all__ = ["PackedLinearWeight", "RANGE_ATTR"]

aten = torch.ops.aten

#: the attribute of a packed weight that holds how its token range (``max_tokens``) is decided: an object
#: whose ``decide(weight, converted_from)`` sets the range of ``weight`` and its kernel decision (set by
#: :mod:`nmcompile.checkpoint.packed_weights`). A conversion to another dtype asks it again: the range
#: measured in one dtype is not the range of another (fp32 -> bf16: a 256-token call took 105 ms, 24 ms in
#: the range bf16 has)
RANGE_ATTR = "_nmcompile_range"


class PackedLinearWeight(Tensor):
    values: Tensor
    bits: Tensor
    scales: Tensor | None

    @staticmethod
    def __new__(cls, values: Tensor, bits: Tensor, shape, max_tokens: int = -1, isa: str = "", transposed: bool = False,
                scales: Tensor | None = None, dtype: torch.dtype | None = None):
        out_f, in_f = shape
        outer = (in_f, out_f) if transposed else (out_f, in_f)
        if (scales is None) != (values.dtype not in (torch.int8, torch.uint8)) \
                or (scales is not None and dtype not in cpu24.DTYPES) or (bits is None and scales is None) \
                or (values.dtype == torch.uint8 and scales.dtype != torch.float16):
            raise ValueError(f"PackedLinearWeight: int8 values need fp32 scales and 4-bit ones (uint8) fp16 group "
                             f"scales, both the activation dtype (one of {cpu24.DTYPES}); float values neither (and "
                             f"need position bits); got {values.dtype} values, scales "
                             f"{None if scales is None else scales.dtype}, dtype {dtype}")
        dtype = values.dtype if scales is None else dtype
        return Tensor._make_wrapper_subclass(cls, outer, dtype=dtype, device=values.device, requires_grad=False)

    def __init__(self, values, bits, shape, max_tokens: int = -1, isa: str = "", transposed: bool = False,
                 scales=None, dtype=None):
        self.values, self.bits, self.scales = values, bits, scales
        self.weight_shape = tuple(int(s) for s in shape)  # [out, in] of the weight it holds
        self.max_tokens, self.isa, self.transposed = int(max_tokens), isa, transposed

    @property
    def dense_rows(self) -> bool:
        """Whether this is a dense int8 or 4-bit weight (every position kept, no position bits; :func:`~nmcompile.
        kernels.cpu24.quantize.quantize_dense`, :func:`~nmcompile.kernels.cpu24.quantize.quantize_dense4`), as an
        output head and its tied embedding are held."""
        return self.bits is None

    @property
    def quantized(self) -> bool:
        """Whether the kept values are codes with ``scales`` (int8 with one fp32 scale a row, or 4-bit: :attr:`int4`;
        :mod:`.quantize`); the tensor's dtype is then the activation dtype it computes in."""
        return self.scales is not None

    @property
    def int4(self) -> bool:
        """Whether the kept values are 4-bit codes with an fp16 scale per row and :attr:`group` of positions
        (:func:`~nmcompile.kernels.cpu24.quantize.quantize_layout4`; ``bits`` then holds their positions as its
        index), computed on the ``avx2_a8`` route."""
        return self.values.dtype == torch.uint8

    @property
    def group(self) -> int:
        """The positions one scale of a 4-bit weight covers (0 for other weights)."""
        return self.weight_shape[1] // self.scales.shape[1] if self.int4 else 0

    @classmethod
    def from_packed(cls, values: Tensor, meta: Tensor, max_tokens: int = -1, isa: str = "") -> "PackedLinearWeight":
        """From :func:`nmcompile.pack`'s ``values`` ``[out, in/2]`` and ``meta`` (no dense weight made)."""
        v, b = cpu24.cpu_layout(values, meta)
        return cls(v, b, (values.shape[0], values.shape[1] * 2), max_tokens, isa or cpu24.best_isa(values.dtype) or "")

    def __repr__(self) -> str:
        values = f", values=int4, group={self.group}" if self.int4 else ", values=int8" if self.quantized else ""
        t = (", transposed" if self.transposed else "") + values \
            + (", dense rows" if self.dense_rows else "")
        return (f"PackedLinearWeight(shape={list(self.weight_shape)}, dtype={self.dtype}, "
                f"max_tokens={self.max_tokens}, isa={self.isa!r}{t})")

    def __tensor_flatten__(self):
        inner = [name for name in ("values", "bits", "scales") if getattr(self, name) is not None]
        return inner, (self.weight_shape, self.max_tokens, self.isa, self.transposed, self.dtype if self.quantized else None)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        *fields, dtype = ctx
        return PackedLinearWeight(inner["values"], inner.get("bits"), *fields, scales=inner.get("scales"), dtype=dtype)

    def _stable_hash_for_caching(self) -> str:  # AOTAutograd's cache: the metadata, not the values
        q = (" int4" if self.int4 else " int8" if self.quantized else "") + (" dense" if self.dense_rows else "")
        return f"PackedLinearWeight {self.weight_shape} {self.dtype} {self.max_tokens} {self.isa} {self.transposed}{q}"

    def __deepcopy__(self, memo):  # PyTorch's own clones wrapper subclasses, and a clone here is dense
        if id(self) in memo:
            return memo[id(self)]
        copied = self._with(values=copy.deepcopy(self.values, memo), bits=copy.deepcopy(self.bits, memo),
                            scales=copy.deepcopy(self.scales, memo))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():  # a parameter's flag and records, as Tensor.__deepcopy__ keeps them
            if key not in copied.__dict__:
                copied.__dict__[key] = copy.deepcopy(value, memo)
        return copied

    def __reduce_ex__(self, protocol):  # torch.save of a model or state dict holding it
        # with the rest of its __dict__: a parameter's flag, its kernel decision and trainable record
        extra = _extra(self)
        quantized = (self.scales, self.dtype) if self.quantized else ()
        return _rebuild, (self.values, self.bits, self.weight_shape, self.max_tokens, self.isa, self.transposed,
                          *((extra,) if extra or quantized else ()), *quantized)

    @property
    def data(self) -> Tensor:
        return torch._C.TensorBase.data.__get__(self, type(self))

    @data.setter
    def data(self, new) -> None:  # PyTorch's setter would swap the storage and leave values and bits as they were
        if isinstance(new, Tensor) and not isinstance(new, PackedLinearWeight) \
                and (new.dtype, new.device.type) != (self.dtype, self.device.type):
            # Module._apply (model.double(), .to(dtype or device)) assigns .data where the result is a plain tensor
            raise RuntimeError(
                f"cannot convert a packed 2:4 weight {list(self.weight_shape)} from {self.dtype} on {self.device.type} "
                f"to {new.dtype} on {new.device.type}: the 2:4 CPU kernel holds float32, bfloat16 or float16 weights "
                "on the CPU (those conversions keep it packed); unpack the model first "
                "(nmcompile.deploy.unpack_weights(model)) to convert its dense weights"
            )
        raise RuntimeError(
            f"assigning .data of a packed 2:4 weight {list(self.weight_shape)} would be ignored: it holds only its kept "
            "values, which .data does not reach; unpack the model first (nmcompile.deploy.unpack_weights(model)), set "
            "the weight, then nmcompile.deploy.pack_weights(model) again"
        )

    @property
    def nbytes_packed(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.bits, self.scales) if t is not None)

    def packed(self) -> tuple[Tensor, Tensor]:
        """``(values, meta)`` in :func:`nmcompile.pack`'s format, for checkpoints."""
        if self.quantized:
            raise NotImplementedError(
                f"a packed 2:4 weight {list(self.weight_shape)} with {'4-bit' if self.int4 else 'int8'} values: the "
                "packed state dict holds float values only, and writing the codes without their scales would lose "
                "the weight; call nmcompile.deploy.unpack_weights(model) (it records each int8 grid) and "
                "nmcompile.deploy.save_pretrained(model, DIR), which writes the codes and scales beside the "
                "dequantized weights"
            )
        return cpu24.packed_layout(self.values, self.bits, self.weight_shape[0])

    def dense(self) -> Tensor:
        """The dense weight (a new tensor; the transpose where this is the transposed view); int8 values
        dequantized (code times its row's scale, in fp32, then the tensor's dtype), 4-bit ones the same with
        their group's scale."""
        _require_kernel()
        if self.int4:
            n = self.weight_shape[0]
            w = quantize.dense_rows4(self.values, self.scales, self.group)[:n] if self.dense_rows else \
                quantize.dense4(self.values, self.bits, self.scales, self.group, n)
            w = w.to(self.dtype)
            return w.t() if self.transposed else w
        if self.dense_rows:
            w = quantize.dense_rows(self.values, self.weight_shape[0])
        else:
            w = torch.ops.nmsparse.cpu24_unpack(self.values, self.bits, self.weight_shape[0])
        if self.quantized:
            w = (w.float() * self.scales[:, None]).to(self.dtype)
        return w.t() if self.transposed else w

    def _with(self, values=None, bits=None, transposed=None, isa=None, scales=None, dtype=None) -> "PackedLinearWeight":
        # an inference tensor only where this one is: a view (t, detach) of a weight made outside
        # torch.inference_mode is a normal tensor whose version counter PyTorch sets to the weight's
        with torch.inference_mode(self.is_inference()):
            out = PackedLinearWeight(
                self.values if values is None else values, self.bits if bits is None else bits, self.weight_shape,
                self.max_tokens, self.isa if isa is None else isa, self.transposed if transposed is None else transposed,
                self.scales if scales is None else scales,
                (dtype or self.dtype) if self.quantized or scales is not None else None,
            )
        # its records (kernel decision, trainable), which Module._apply (.to, share_memory) would lose
        # when it wraps the result in a new Parameter; not the parameter flag itself
        out.__dict__.update(_extra(self, "_is_param"))
        return out

    def _rows(self, indices: Tensor) -> Tensor:
        """``F.embedding(indices, W)`` of a dense int8 or 4-bit weight: only the rows looked up are dequantized."""
        n = self.weight_shape[0]
        if not torch.compiler.is_compiling() and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= n):
            raise IndexError(f"embedding: an index is out of range for a table of {n} rows (got {int(indices.min())} to "
                             f"{int(indices.max())})")
        flat = indices.reshape(-1)
        if self.int4:
            out = quantize.dense_rows4(self.values, self.scales, self.group, flat).to(self.dtype)
        else:
            rows = quantize.dense_rows(self.values, n).index_select(0, flat)
            out = (rows.float() * self.scales.index_select(0, flat)[:, None]).to(self.dtype)
        return out.reshape(*indices.shape, self.weight_shape[1])

    def _inner(self) -> tuple[Tensor, ...]:
        return tuple(t for t in (self.values, self.bits, self.scales) if t is not None)

    def share_memory_(self) -> "PackedLinearWeight":
        """Move the values, bits (and scales) to shared memory (PyTorch's own would read a storage this wrapper
        has not)."""
        for t in self._inner():
            t.share_memory_()
        return self

    def is_shared(self) -> bool:
        return all(t.is_shared() for t in self._inner())

    def _linear(self, x: Tensor, bias) -> Tensor:
        """``F.linear(x, W, bias)`` on the kernel, ``W`` the ``[out, in]`` weight this holds."""
        _require_kernel()
        if self.dense_rows and self.int4:
            return torch.ops.nmsparse.cpu24_dense_q4(
                x, self.values, self.scales, bias, self.weight_shape[0], self.group, self.max_tokens, self.isa
            )
        if self.dense_rows:
            return torch.ops.nmsparse.cpu24_dense_q8(
                x, self.values, self.scales, bias, self.weight_shape[0], self.max_tokens, self.isa or "avx2"
            )
        if self.int4:
            return torch.ops.nmsparse.cpu24_linear_q4(
                x, self.values, self.bits, self.scales, bias, self.weight_shape[0], self.group, self.max_tokens, self.isa
            )
        if self.quantized:
            return torch.ops.nmsparse.cpu24_linear_q8(
                x, self.values, self.bits, self.scales, bias, self.weight_shape[0], self.max_tokens, self.isa or "avx2"
            )
        return torch.ops.nmsparse.cpu24_linear(
            x, self.values, self.bits, bias, None, self.weight_shape[0], self.max_tokens, self.isa or "avx2"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._with()
        if func is aten.t.default or (func is aten.transpose.int and sorted(a % 2 for a in args[1:3]) == [0, 1]):
            return args[0]._with(transposed=not args[0].transposed)
        if func in (aten.mm.default, aten.addmm.default):
            bias, x, w = (None, *args[:2]) if func is aten.mm.default else args[:3]
            if isinstance(w, PackedLinearWeight) and w.transposed and not isinstance(x, PackedLinearWeight) \
                    and (bias is None or (bias.dim() == 1 and not kwargs)):
                return w._linear(x, bias)
        # under torch.inference_mode the composite ops arrive whole (no autograd key decomposes them)
        if func is aten.linear.default:
            x, w, bias = (*args, None)[:3] if len(args) < 3 else args[:3]
            bias = kwargs.get("bias", bias)
            if isinstance(w, PackedLinearWeight) and not w.transposed and not isinstance(x, PackedLinearWeight) \
                    and not isinstance(bias, PackedLinearWeight) and x.dim() >= 1:
                return w._linear(x, bias)
        if func is aten.matmul.default and not kwargs:
            x, w = args[:2]
            if isinstance(w, PackedLinearWeight) and w.transposed and not isinstance(x, PackedLinearWeight) \
                    and x.dim() >= 2:
                return w._linear(x, None)
        if func is aten.embedding.default and isinstance(args[0], PackedLinearWeight) and args[0].dense_rows \
                and not args[0].transposed and not isinstance(args[1], PackedLinearWeight):
            return args[0]._rows(args[1])  # a tied embedding: the rows looked up, dequantized
        if func is aten._to_copy.default or func.overloadpacket is aten.to:
            cast = _cast(func, args, kwargs)
            if cast is not None:
                return cast
        if any(isinstance(t, PackedLinearWeight) for t in _written(func, args, kwargs)):
            raise RuntimeError(
                f"{func} would write into a packed 2:4 weight, which holds only its kept values; unpack the model "
                "first (nmcompile.deploy.unpack_weights(model)) to change weights"
            )
        dense = tree_map(lambda t: t.dense() if isinstance(t, PackedLinearWeight) else t, (args, kwargs))
        return func(*dense[0], **dense[1])


def _require_kernel() -> None:
    """Load the 2:4 CPU kernel's ops (once per process), or say why a packed weight cannot be computed here."""
    state = cpu24.status()
    if not state.available:
        raise RuntimeError(
            f"a packed 2:4 weight is computed by the 2:4 CPU kernel, which is not available here: {state.reason}; "
            "on such a machine load its checkpoint dense (nmcompile.deploy.unpack_state_dict)"
        )


#: the attributes :meth:`PackedLinearWeight.__init__` sets (the rest of a weight's __dict__ is pickled beside them)
_OWN = frozenset({"values", "bits", "scales", "weight_shape", "max_tokens", "isa", "transposed"})


def _bound(func, args, kwargs) -> dict:
    """``func``'s arguments by name."""
    return {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs}


def _written(func, args, kwargs) -> list:
    """The arguments ``func`` writes into (``self`` of an in-place op, ``out=``): a packed weight may be read
    by a write into a dense tensor (``dense.copy_(packed)``: ``load_state_dict`` into a plain model)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    bound = _bound(func, args, kwargs)
    return [bound.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _cast(func, args, kwargs):
    """``weight.to(dtype)`` (``_to_copy``, or ``to`` as it arrives under ``torch.inference_mode``) kept packed
    where the kernel takes the dtype, on the CPU; None for other conversions (computed on the dense weight)."""
    bound = _bound(func, args, kwargs)
    w = bound.get("self")
    if not isinstance(w, PackedLinearWeight):
        return None
    dtype = bound.get("dtype") or w.dtype
    device = bound.get("device")
    if dtype not in cpu24.DTYPES or (device is not None and torch.device(device).type != "cpu") \
            or bound.get("layout") not in (None, torch.strided) or bound.get("pin_memory"):
        return None
    if func is not aten._to_copy.default and dtype == w.dtype and not bound.get("copy"):
        return w  # to() of what it already is: the weight itself, as for any tensor
    if w.quantized:  # the int8 codes and fp32 scales stay; the dtype the kernel computes in changes
        values = w.values.clone()
        out = w._with(values=values, scales=w.scales.clone(), dtype=dtype)
    else:
        values = w.values.to(dtype, copy=True)
        # the fastest ISA for the new dtype where the weight had the fastest for its own (avx512_bf16 is for
        # bf16 only), else the one it was given, where that takes the new dtype
        keep = w.isa in _isas_for(dtype) and w.isa != cpu24.best_isa(w.dtype)
        out = w._with(values=values, isa=w.isa if keep else cpu24.best_isa(dtype) or w.isa)
    rule = getattr(w, RANGE_ATTR, None)
    # the range for the new dtype (from the decision cache, else timed), on real weights: a cast traced by
    # torch.compile (fake tensors) keeps the weight's range
    if dtype != w.dtype and rule is not None and type(values) is Tensor and not torch.compiler.is_compiling():
        rule.decide(out, w.dtype)
    return out


def _isas_for(dtype: torch.dtype) -> tuple:
    return tuple(name for name in cpu24.ISAS if name != "avx512_bf16" or dtype == torch.bfloat16)


def _extra(weight: PackedLinearWeight, *leave: str) -> dict:
    """What ``weight``'s __dict__ holds beyond its own fields (and PyTorch's cached size capsules)."""
    return {k: v for k, v in weight.__dict__.items() if k not in _OWN and k not in leave and not k.startswith("_sym_")}


def _rebuild(values, bits, shape, max_tokens, isa, transposed, extra=None, scales=None, dtype=None):
    # unpickled in a fresh process (torch.load of a whole model): register the kernel's ops now, as
    # pack_weights and load_packed did where the weight was made (a machine without it is named at use)
    cpu24.status()
    weight = PackedLinearWeight(values, bits, shape, max_tokens, isa, transposed, scales, dtype)
    weight.__dict__.update(extra or {})
    return weight
