"""The 2:4 CPU kernel: a native library built at first use, its layout, and the ``nmsparse::cpu24_*`` ops.

The C++ sources beside this file (``cpu24_*.cpp``, ``cpu24_*.h``) are compiled by PyTorch's extension builder
(:func:`torch.utils.cpp_extension.load`, with the C++ compiler Inductor already needs) the first
time a process asks for them, into PyTorch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), so later processes only load the library. The ops it registers:

- ``nmsparse::cpu24_linear(x, values, bits, bias, weight, max_tokens, isa)``: ``F.linear`` with a 2:4
  weight held as ``values`` ``[N, K/2]`` (the weight's dtype) and ``bits`` ``[N, K/16]`` (int16, one
  bit per kept position, :func:`cpu_layout`); calls with more than ``max_tokens`` rows
  (``max_tokens >= 0``) take the dense GEMM, on ``weight`` when given, else on the weight unpacked
  for the call. fp32 accumulation, any token count, any input strides, the bias fused;
- ``nmsparse::cpu24_unpack(values, bits)``: the dense weight;
- ``nmsparse::cpu24_isa()``: what this CPU runs (:data:`ISAS`);
- ``nmsparse::cpu24_split_probe(x, values, bits, out_features, isa, slow_thread, slow_us, route)``: the
  sparse product with one thread slowed down, the row chunks each thread computed, the route
  taken and the calls left that take the pool after it (tests of the split).

Threads (up to ``torch.get_num_threads()``) claim small chunks of row groups as they finish
(``nmcompile/kernels/cpu24/cpu24_split.h``), so a thread whose core is busy with another process takes fewer chunks
instead of holding every call. They are PyTorch's OpenMP team, or, for a while after a call whose
team kept the caller waiting (a busy core), the caller plus tasks on PyTorch's inter-op pool, which
return without waiting for a thread that has not started.

:func:`status` says whether the kernel can run here and, if not, why (not x86-64, no compiler, a
failed build with the compiler's message); the deploy dispatch then keeps the dense kernel and
reports that reason. Nothing here runs at import.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...ops import register_autocast

__all__ = ["Status", "status", "library_name", "isas", "best_isa", "int8_isa", "cpu_layout", "packed_layout", "cpu_pack",
           "unpack", "ISAS", "A8_ISA", "DTYPES", "GROUP"]

SOURCES = Path(__file__).parent  # the C++ sources sit beside this file
#: ISA names the op takes, with the cpu24_isa() bits each needs. Measured on a Zen 5 core
#: (``benchmarks/cpu/cpu24_isa.py``): ``avx512`` (one or two tokens on the AVX2 rows) was the fastest for
#: fp32 and fp16 weights, ``avx2`` for bf16 ones (1-4 tokens, where the kernel beats dense bf16);
#: ``avx512_bf16`` (bf16 pairs) no default picks: at one token it ran 0.82-1.26x dense bf16 against
#: ``avx2``'s 2.3-3.3x, and from 16 tokens on, where it was the fastest of the three, dense bf16 (native
#: there) beat all of them
ISAS = {"avx512": 2, "avx2": 1, "avx512_bf16": 4}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: at::parallel_for is OpenMP in the header: without -fopenmp cpu24_unpack would run on one thread
FLAGS = ["-O3", "-std=c++17", "-fopenmp"]


@dataclass(frozen=True)
class Status:
    available: bool
    reason: str  # why not, or which ISAs the CPU runs
    build_seconds: float = 0.0  # time spent building or loading in this process


def _compiler() -> str:
    """The C++ compiler the build runs (``CXX``, else ``c++``): its resolved path and first line of
    ``--version``, or its name where it cannot be asked."""
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name)
    if path is None:
        return name
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(path)} {version.splitlines()[0] if version else ''}"


def _library_name() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    # the torch installation, not only its version: its headers' path is part of the build's arguments,
    # so two environments building one name rebuilt it for each other in turn
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    digest.update(f"{torch.__version__} {torch_dir} {FLAGS} {_compiler()}".encode())
    return f"nmcompile_cpu24_{digest.hexdigest()[:12]}"


@functools.lru_cache(maxsize=1)
def library_name() -> str:
    """The native library's name, which is also its build folder's: a digest of its sources, the torch
    installation (version and path), the flags and the compiler. A change of any of them is a new build
    beside the others (never a rebuild of another environment's) and a new key for measured decisions."""
    return _library_name()


@functools.lru_cache(maxsize=1)
def status() -> Status:
    """Build (first use on this machine) or load the native library, once per process."""
    import time

    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return Status(False, f"the 2:4 CPU kernel is x86-64 only (this CPU is {platform.machine() or 'unknown'})")
    if os.name != "posix":
        return Status(False, "the 2:4 CPU kernel is built with GCC on Linux only")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return Status(False, f"no C++ compiler ({compiler!r} is not on PATH; Inductor's CPU backend needs one too)")
    start = time.perf_counter()
    try:
        _build()
        _register_python_parts()
    except Exception as err:  # a failed build is a named fallback, never an error
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        # the compiler's own diagnostics ("file:line: error: ...", "fatal error: ..."), else the first lines
        diagnostics = [line for line in lines if "error:" in line.lower()]
        detail = " | ".join(diagnostics[:4] or lines[:3])[:600]
        return Status(False, f"building the 2:4 CPU kernel failed ({type(err).__name__}): {detail}")
    seconds = time.perf_counter() - start
    names = [name for name, needs in ISAS.items() if int(torch.ops.nmsparse.cpu24_isa()) & needs == needs]
    if not names:
        return Status(False, "this CPU has neither AVX2+FMA+F16C nor AVX-512", seconds)
    return Status(True, f"CPU runs {', '.join(names)}", seconds)


def _build() -> None:
    from torch.utils import cpp_extension

    sources = sorted(str(p) for p in SOURCES.glob("*.cpp"))
    env_path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the ninja wheel's binary, for this build only
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{env_path}"
    try:
        cpp_extension.load(
            name=library_name(), sources=sources, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.environ["PATH"] = env_path


def isas() -> tuple[str, ...]:
    """The ISAs this CPU runs, in the order of :data:`ISAS` (empty where the kernel is unavailable)."""
    if not status().available:
        return ()
    flags = int(torch.ops.nmsparse.cpu24_isa())
    return tuple(name for name, needs in ISAS.items() if flags & needs == needs)


#: the route of int8 weights (2:4 or dense rows) that quantizes each call's activations to int8 in blocks of 32
#: (scale: the block's largest magnitude / 127) and multiplies integers (``cpu24_a8.cpp``); AVX2 CPUs
A8_ISA = "avx2_a8"


def int8_isa(activations: str) -> str:
    """The ISA of int8 weights whose products take their activations in ``activations``: ``"float"`` (the
    layer's dtype, widened to fp32: :func:`best_isa`) or ``"int8"`` (:data:`A8_ISA`). ValueError where this CPU
    cannot run it, or for another value."""
    if activations == "float":
        return best_isa(torch.int8) or "avx2"
    if activations != "int8":
        raise ValueError(f"activations={activations!r}: int8 weights take their activations as 'float' (the layer's "
                         "dtype) or 'int8' (quantized in blocks of 32, integer products)")
    if "avx2" not in isas():
        raise ValueError("activations='int8' runs on the AVX2 integer kernel, which this machine cannot run ("
                         f"{status().reason}); keep activations='float'")
    return A8_ISA


def best_isa(dtype: torch.dtype) -> str | None:
    """The ISA that packed ``dtype`` weights run here (:data:`ISAS`): ``avx2`` for bf16, else the first
    this CPU runs of ``avx512`` and ``avx2``; ``avx512_bf16`` only where a caller names it."""
    here = [name for name in isas() if name != "avx512_bf16"]
    if dtype == torch.bfloat16 and "avx2" in here:
        return "avx2"
    return here[0] if here else None


GROUP = 8  # rows per group of the CPU layout (NM24_GROUP in nmcompile/kernels/cpu24/cpu24_args.h)


@functools.lru_cache(maxsize=None)
def _bits_table() -> tuple[Tensor, Tensor]:
    """For every 16-bit metadata word: the position bits it encodes (int16), and whether each of its four groups
    holds two positions i0 < i1 (what :func:`nmcompile.pack` writes)."""
    words = torch.arange(1 << 16, dtype=torch.int32)
    shifts = torch.arange(4, dtype=torch.int32) * 4
    nibbles = (words[..., None] >> shifts) & 0xF
    first, second = nibbles & 3, nibbles >> 2
    bits = (((1 << first) | (1 << second)) << shifts).sum(-1)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16), (first < second).all(-1)


def _word_bits(meta: Tensor) -> Tensor:
    """Each 16-bit metadata word (four nibbles ``i0 | i1 << 2``) as the 16 position bits it encodes (one lookup
    a word: a 1B model's packed file loads in a second, not four)."""
    table, valid = (t.to(meta.device) for t in _bits_table())
    index = meta.to(torch.int32).bitwise_and_(0xFFFF).long()
    if not bool(valid[index].all()):
        raise ValueError("cpu_layout: the metadata has groups whose two positions are not i0 < i1; pass what "
                         "nmcompile.pack returned")
    return table[index]


def _word_meta(bits: Tensor) -> Tensor:
    """The inverse of :func:`_word_bits`."""
    words = bits.to(torch.int32) & 0xFFFF
    shifts = torch.arange(4, dtype=torch.int32, device=bits.device) * 4
    group = ((words[..., None] >> shifts) & 0xF).long()  # 4 position bits per group, two set
    code = torch.zeros(16, dtype=torch.int32, device=bits.device)
    for i in range(4):
        for j in range(i + 1, 4):
            code[(1 << i) | (1 << j)] = i | (j << 2)
    words = (code[group] << shifts).sum(-1)
    return torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)


def cpu_layout(values: Tensor, meta: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's layout of a packed 2:4 weight (:func:`nmcompile.pack`'s ``values`` ``[N, K/2]``
    and ``meta`` ``[N, K/16]``): rows in groups of :data:`GROUP` (``N`` padded with zero rows), per
    group and 16-position word the rows side by side, so a kernel step reads one contiguous run:
    ``values`` ``[groups, K/16, GROUP, 8]`` and ``bits`` ``[groups, K/16, GROUP]`` (int16, bit ``j``
    set iff position ``16w + j`` is kept). The same bytes as the packed format, plus the padding."""
    if meta.dtype != torch.int16 or values.dim() != 2 or tuple(meta.shape) != (values.shape[0], values.shape[1] // 8) \
            or values.shape[1] % 8:
        raise ValueError(f"cpu_layout takes nmcompile.pack's values [N, K/2] and int16 meta [N, K/16], got "
                         f"{tuple(values.shape)} {values.dtype} and {tuple(meta.shape)} {meta.dtype}")
    n, words = meta.shape
    groups = -(-n // GROUP)
    bits = _word_bits(meta)
    pad = groups * GROUP - n
    if pad:  # zero rows; their bits keep the first two positions of each group
        values = torch.cat([values, values.new_zeros(pad, values.shape[1])])
        bits = torch.cat([bits, bits.new_full((pad, words), 0x3333)])
    values = values.reshape(groups, GROUP, words, 8).transpose(1, 2).contiguous()
    bits = bits.reshape(groups, GROUP, words).transpose(1, 2).contiguous()
    return values, bits


def packed_layout(values: Tensor, bits: Tensor, out_features: int) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`cpu_layout`: ``(values, meta)`` in :func:`nmcompile.pack`'s format."""
    groups, words = bits.shape[:2]
    v = values.transpose(1, 2).reshape(groups * GROUP, words * 8)[:out_features]
    b = bits.transpose(1, 2).reshape(groups * GROUP, words)[:out_features]
    return v.contiguous(), _word_meta(b).contiguous()


@functools.lru_cache(maxsize=None)
def _pack_tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per group code (bit ``p`` set iff position ``p`` is non-zero): the two positions :func:`nmcompile.pack`
    keeps (non-zeros first, then the first zeros, in index order), their bits, and whether it has > 2 non-zeros."""
    kept, masks_, over = [], [], []
    for code in range(16):
        order = [p for p in range(4) if code >> p & 1] + [p for p in range(4) if not code >> p & 1]
        first, second = sorted(order[:2])
        kept.append([first, second])
        masks_.append((1 << first) | (1 << second))
        over.append(bin(code).count("1") > 2)
    return (torch.tensor(kept, device=device), torch.tensor(masks_, dtype=torch.int32, device=device),
            torch.tensor(over, device=device))


def cpu_pack(weight: Tensor) -> tuple[Tensor, Tensor, int]:
    """``(values, bits, groups with more than 2 non-zeros)``: the kernel's layout (:func:`cpu_layout`) of a
    2-D 2:4 weight ``[N, K]`` (``K`` a multiple of 16), made in one pass without the metadata codes.

    The same layout as ``cpu_layout(*nmcompile.pack(weight))``, also for a group with more than two
    non-zeros (its first two are kept; the count says how many there were), with fewer and smaller
    temporaries (some 12 bytes an element): for packing a weight chunk by chunk as it is read."""
    n, k = weight.shape
    if k % 16:
        raise ValueError(f"cpu_pack: the last dim ({k}) must be a multiple of 16")
    pad = -n % GROUP
    if pad:  # zero rows keep positions 0 and 1 of each group: bits 0x3333, as cpu_layout pads
        weight = torch.cat([weight, weight.new_zeros(pad, k)])
    kept, kept_bits, over = _pack_tables(weight.device)
    groups = weight.reshape(n + pad, k // 4, 4)
    weights = torch.tensor([1, 2, 4, 8], dtype=torch.uint8, device=weight.device)
    code = ((groups != 0) * weights).sum(-1, dtype=torch.uint8).long()
    violations = int(over[code].sum())
    values = groups.gather(-1, kept[code]).reshape(n + pad, k // 2)
    shifts = torch.arange(4, dtype=torch.int32, device=weight.device) * 4
    words = (kept_bits[code].reshape(n + pad, k // 16, 4) << shifts).sum(-1, dtype=torch.int32)
    bits = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    rows = (n + pad) // GROUP
    values = values.reshape(rows, GROUP, k // 16, 8).transpose(1, 2).contiguous()
    bits = bits.reshape(rows, GROUP, k // 16).transpose(1, 2).contiguous()
    return values, bits, violations


def _require() -> None:
    state = status()
    if not state.available:
        raise RuntimeError(f"the 2:4 CPU kernel is not available here: {state.reason}")


def unpack(values: Tensor, bits: Tensor, out_features: int) -> Tensor:
    """The dense ``[out_features, K]`` weight that the CPU layout ``values``/``bits`` hold."""
    _require()
    return torch.ops.nmsparse.cpu24_unpack(values, bits, out_features)


def _register_python_parts() -> None:
    """Fake (shape) functions of the C++ ops and the AutocastCPU kernel; called once after loading (the
    autograd of ``cpu24_linear`` is C++: ``nmcompile/kernels/cpu24/cpu24_autograd.cpp``)."""
    lib = "nmsparse::cpu24_linear"

    @torch.library.register_fake(lib)
    def _(x, values, bits, bias, weight, out_features, max_tokens, isa):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("nmsparse::cpu24_linear_q8")
    def _(x, values, bits, scales, bias, out_features, max_tokens, isa):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("nmsparse::cpu24_linear_q4")
    def _(x, values, bits, scales, bias, out_features, group, max_tokens, isa):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("nmsparse::cpu24_dense_q4")
    def _(x, values, scales, bias, out_features, group, max_tokens, isa):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("nmsparse::cpu24_dense_q8")
    def _(x, values, scales, bias, out_features, max_tokens, isa):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("nmsparse::cpu24_unpack")
    def _(values, bits, out_features):
        return values.new_empty((out_features, bits.shape[1] * 16))

    # the AutocastCPU kernel: x, bias, weight and values cast as F.linear casts its operands (the values are
    # plain weights in the CPU layout; the bits are int16 and stay)
    register_autocast(torch.ops.nmsparse.cpu24_linear.default, devices=("cpu",))
