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
inner tensors. Read-only: in-place ops, ``.data`` assignment and gradients are refused with what to
do instead.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from . import cpu24

__all__ = ["PackedLinearWeight"]

aten = torch.ops.aten


class PackedLinearWeight(Tensor):
    values: Tensor
    bits: Tensor

    @staticmethod
    def __new__(cls, values: Tensor, bits: Tensor, shape, max_tokens: int = -1, isa: str = "", transposed: bool = False):
        out_f, in_f = shape
        outer = (in_f, out_f) if transposed else (out_f, in_f)
        return Tensor._make_wrapper_subclass(cls, outer, dtype=values.dtype, device=values.device, requires_grad=False)

    def __init__(self, values, bits, shape, max_tokens: int = -1, isa: str = "", transposed: bool = False):
        self.values, self.bits = values, bits
        self.weight_shape = tuple(int(s) for s in shape)  # [out, in] of the weight it holds
        self.max_tokens, self.isa, self.transposed = int(max_tokens), isa, transposed

    @classmethod
    def from_packed(cls, values: Tensor, meta: Tensor, max_tokens: int = -1, isa: str = "") -> "PackedLinearWeight":
        """From :func:`nmcompile.pack`'s ``values`` ``[out, in/2]`` and ``meta`` (no dense weight made)."""
        v, b = cpu24.cpu_layout(values, meta)
        return cls(v, b, (values.shape[0], values.shape[1] * 2), max_tokens, isa or cpu24.best_isa(values.dtype) or "")

    def __repr__(self) -> str:
        t = ", transposed" if self.transposed else ""
        return (f"PackedLinearWeight(shape={list(self.weight_shape)}, dtype={self.dtype}, "
                f"max_tokens={self.max_tokens}, isa={self.isa!r}{t})")

    def __tensor_flatten__(self):
        return ["values", "bits"], (self.weight_shape, self.max_tokens, self.isa, self.transposed)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return PackedLinearWeight(inner["values"], inner["bits"], *ctx)

    def _stable_hash_for_caching(self) -> str:  # AOTAutograd's cache: the metadata, not the values
        return f"PackedLinearWeight {self.weight_shape} {self.dtype} {self.max_tokens} {self.isa} {self.transposed}"

    def __deepcopy__(self, memo):  # PyTorch's own clones wrapper subclasses, and a clone here is dense
        if id(self) in memo:
            return memo[id(self)]
        copied = self._with(values=copy.deepcopy(self.values, memo), bits=copy.deepcopy(self.bits, memo))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():  # a parameter's flag and records, as Tensor.__deepcopy__ keeps them
            if key not in copied.__dict__:
                copied.__dict__[key] = copy.deepcopy(value, memo)
        return copied

    def __reduce_ex__(self, protocol):  # torch.save of a model or state dict holding it
        # with the rest of its __dict__: a parameter's flag, its kernel decision and trainable record
        extra = _extra(self)
        return _rebuild, (self.values, self.bits, self.weight_shape, self.max_tokens, self.isa, self.transposed,
                          *((extra,) if extra else ()))

    @property
    def data(self) -> Tensor:
        return torch._C.TensorBase.data.__get__(self, type(self))

    @data.setter
    def data(self, new) -> None:  # PyTorch's setter would swap the storage and leave values and bits as they were
        raise RuntimeError(
            f"assigning .data of a packed 2:4 weight {list(self.weight_shape)} would be ignored: it holds only its kept "
            "values, which .data does not reach; unpack the model first (nmcompile.deploy.unpack_weights(model)), set "
            "the weight, then nmcompile.deploy.pack_weights(model) again"
        )

    @property
    def nbytes_packed(self) -> int:
        return self.values.numel() * self.values.element_size() + self.bits.numel() * self.bits.element_size()

    def packed(self) -> tuple[Tensor, Tensor]:
        """``(values, meta)`` in :func:`nmcompile.pack`'s format, for checkpoints."""
        return cpu24.packed_layout(self.values, self.bits, self.weight_shape[0])

    def dense(self) -> Tensor:
        """The dense weight (a new tensor; the transpose where this is the transposed view)."""
        _require_kernel()
        w = torch.ops.nmsparse.cpu24_unpack(self.values, self.bits, self.weight_shape[0])
        return w.t() if self.transposed else w

    def _with(self, values=None, bits=None, transposed=None) -> "PackedLinearWeight":
        # an inference tensor only where this one is: a view (t, detach) of a weight made outside
        # torch.inference_mode is a normal tensor whose version counter PyTorch sets to the weight's
        with torch.inference_mode(self.is_inference()):
            out = PackedLinearWeight(
                self.values if values is None else values, self.bits if bits is None else bits, self.weight_shape,
                self.max_tokens, self.isa, self.transposed if transposed is None else transposed,
            )
        # its records (kernel decision, trainable), which Module._apply (.to, share_memory) would lose
        # when it wraps the result in a new Parameter; not the parameter flag itself
        out.__dict__.update(_extra(self, "_is_param"))
        return out

    def share_memory_(self) -> "PackedLinearWeight":
        """Move the values and bits to shared memory (PyTorch's own would read a storage this wrapper has not)."""
        self.values.share_memory_()
        self.bits.share_memory_()
        return self

    def is_shared(self) -> bool:
        return self.values.is_shared() and self.bits.is_shared()

    def _linear(self, x: Tensor, bias) -> Tensor:
        """``F.linear(x, W, bias)`` on the kernel, ``W`` the ``[out, in]`` weight this holds."""
        _require_kernel()
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
        if func is aten._to_copy.default and set(kwargs) <= {"dtype"} and kwargs.get("dtype") in cpu24.DTYPES:
            w = args[0]
            return w._with(values=w.values.to(kwargs["dtype"]))
        if getattr(func, "_schema", None) is not None and func._schema.is_mutable:
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
_OWN = frozenset({"values", "bits", "weight_shape", "max_tokens", "isa", "transposed"})


def _extra(weight: PackedLinearWeight, *leave: str) -> dict:
    """What ``weight``'s __dict__ holds beyond its own fields (and PyTorch's cached size capsules)."""
    return {k: v for k, v in weight.__dict__.items() if k not in _OWN and k not in leave and not k.startswith("_sym_")}


def _rebuild(values, bits, shape, max_tokens, isa, transposed, extra=None):
    # unpickled in a fresh process (torch.load of a whole model): register the kernel's ops now, as
    # pack_weights and load_packed did where the weight was made (a machine without it is named at use)
    cpu24.status()
    weight = PackedLinearWeight(values, bits, shape, max_tokens, isa, transposed)
    weight.__dict__.update(extra or {})
    return weight
