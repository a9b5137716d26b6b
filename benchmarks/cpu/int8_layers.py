"""2:4 with int8 values against what a CPU user runs instead, per layer: dense bf16 and fp32 ``F.linear``,
PyTorch's weight-only int8 (``aten._weight_int8pack_mm``, per-channel scales) and int4
(``aten._weight_int4pack_mm_for_cpu``, group 128), nmcompile's 2:4 bf16 packed, and 2:4+int8
(``nmsparse::cpu24_linear_q8``), bf16 activations; 2:4+int8 with the activations quantized to int8 in blocks
of 32 (``isa="avx2_a8"``, integer products); and 2:4+int4 on that route (``nmsparse::cpu24_linear_q4``, an fp16
scale per row and group of 64 or 128 positions).

Each variant runs ``--layers`` distinct Linear(4096, 4096) weights in turn (one pass = one call per layer),
for each token count and thread count; every variant is timed in the same rotated rounds (medians), so a
drift of the machine's bandwidth falls on all of them alike. Per variant: ms per pass, the weight bytes it
reads per second (its format's bytes / time), and its speed against the best dense and the best torch
quantized variant at that token and thread count.

    python benchmarks/cpu/int8_layers.py                           # 1 and 2 threads, 1, 8, 32, 128 tokens
    python benchmarks/cpu/int8_layers.py --tokens 1 --layers 16    # more layers: weights far past the L3
    python benchmarks/cpu/int8_layers.py --out benchmarks/results/int8_layers.json

Figures are as good as the machine is quiet: run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from nmcompile import pack
from nmcompile.kernels import cpu24
from nmcompile.kernels.cpu24.quantize import quantize_layout, quantize_layout4
from nmcompile.masks.topn import prune

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import interleaved_samples, machine  # noqa: E402

DENSE = ("dense bf16", "dense fp32")
TORCH_Q = ("torch int8 weight-only", "torch int4 weight-only g128")
#: the same 2:4+int8 weight on the route that quantizes the activations to int8 (blocks of 32) and multiplies
#: integers (``isa="avx2_a8"``)
A8 = "2:4+int8, int8 activations"
#: 2:4 with 4-bit values on that route, by group size (positions a scale covers)
INT4 = {"2:4+int4 g64": 64, "2:4+int4 g128": 128}


def weights(out_f: int, in_f: int, seed: int) -> dict:
    """One layer's weight in every format, and the bytes each format reads per call."""
    g = torch.Generator().manual_seed(seed)
    w = prune(torch.randn(out_f, in_f, generator=g) * 0.02, 2, 4)
    bf16 = w.to(torch.bfloat16)
    p = pack(bf16)
    values, bits = cpu24.cpu_layout(p.values, p.meta)
    codes, scales = quantize_layout(values, out_f)
    dense8 = w.abs().amax(1) / 127
    int8 = torch.round(w / dense8[:, None]).clamp(-127, 127).to(torch.int8)
    layer = {
        "dense bf16": (bf16,), "dense fp32": (w.contiguous(),),
        "torch int8 weight-only": (int8, dense8.to(torch.bfloat16)),
        "2:4 bf16": (values, bits), "2:4+int8": (codes, bits, scales),
    }
    if "avx2" in cpu24.isas():
        layer[A8] = (codes, bits, scales)
    nbytes = {"dense bf16": bf16.nbytes, "dense fp32": w.nbytes, "torch int8 weight-only": int8.nbytes + out_f * 2,
              "2:4 bf16": values.nbytes + bits.nbytes, "2:4+int8": codes.nbytes + bits.nbytes + scales.nbytes}
    if A8 in layer:
        nbytes[A8] = nbytes["2:4+int8"]
        for name, group in INT4.items():
            codes4, index4, scales4 = quantize_layout4(values, bits, out_f, group)
            layer[name] = (codes4, index4, scales4, group)
            nbytes[name] = codes4.nbytes + index4.nbytes + scales4.nbytes
    try:  # int4: group-wise, bf16 scale and zero per group of 128, in the layout the CPU kernel takes
        group = 128
        grouped = w.reshape(out_f, in_f // group, group)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = torch.round((grouped - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # scales_and_zeros [K/group, N, 2]: w = (q - 8) * scale + zero, zero = lo + 8 * scale
        sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        layer["torch int4 weight-only g128"] = (packed4, group, sz)
        nbytes["torch int4 weight-only g128"] = out_f * in_f // 2 + sz.nbytes
    except (RuntimeError, AttributeError) as err:
        print(f"int4 weight-only left out: {err}", file=sys.stderr)
    return layer, nbytes


def call(name: str, x: torch.Tensor, w: tuple, out_f: int, isa: str):
    if name == "dense bf16":
        return F.linear(x, w[0])
    if name == "dense fp32":
        return F.linear(x.float(), w[0])
    if name == "torch int8 weight-only":
        return torch.ops.aten._weight_int8pack_mm(x, w[0], w[1])
    if name == "torch int4 weight-only g128":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], w[1], w[2])
    if name in INT4:
        return torch.ops.nmsparse.cpu24_linear_q4(x, w[0], w[1], w[2], None, out_f, w[3], -1, cpu24.A8_ISA)
    if name == "2:4 bf16":
        return torch.ops.nmsparse.cpu24_linear(x, w[0], w[1], None, None, out_f, -1, isa)
    return torch.ops.nmsparse.cpu24_linear_q8(x, w[0], w[1], w[2], None, out_f, -1, "avx2_a8" if name == A8 else isa)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not cpu24.status().available:
        raise SystemExit(f"the 2:4 CPU kernel is not available here: {cpu24.status().reason}")
    isa = cpu24.best_isa(torch.bfloat16)
    layers = [weights(args.size, args.size, seed) for seed in range(args.layers)]
    names = list(layers[0][0])
    nbytes = {name: sum(nb[name] for _, nb in layers) for name in names}
    # every variant computes the same layer: its error against the fp32 product of the unquantized weight,
    # relative to that product's scale (int8 ~1e-2, int4 ~1e-1: a wrong layout would be ~1)
    x = torch.randn(3, args.size).to(torch.bfloat16)
    with torch.no_grad():
        exact = F.linear(x.float(), layers[0][0]["dense fp32"][0])
        errors = {name: float((call(name, x, layers[0][0][name], args.size, isa).float() - exact).norm() / exact.norm())
                  for name in names}
    print("relative error against the fp32 product:", {k: round(v, 4) for k, v in errors.items()}, flush=True)
    if max(errors.values()) > 0.3:
        raise SystemExit(f"a variant computes another product: {errors}")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.size).to(torch.bfloat16)

            def run(name, x=x):
                def one_pass():
                    for layer, _ in layers:
                        call(name, x, layer[name], args.size, isa)
                return one_pass

            with torch.no_grad():
                samples = interleaved_samples({name: run(name) for name in names}, args.rounds, warmup=2)
            ms = {name: statistics.median(t) * 1e3 for name, t in samples.items()}
            best_dense = min(ms[n] for n in DENSE if n in ms)
            best_q = min(ms[n] for n in TORCH_Q if n in ms)
            for name in names:
                row = {"threads": threads, "tokens": tokens, "variant": name, "ms": round(ms[name], 3),
                       "weight_GBps": round(nbytes[name] / ms[name] / 1e6, 2),
                       "vs_best_dense": round(best_dense / ms[name], 3), "vs_best_torch_quantized": round(best_q / ms[name], 3)}
                if name in INT4:
                    row["vs_2:4+int8_int8_activations"] = round(ms[A8] / ms[name], 3)
                rows.append(row)
                vs_a8 = f"  {row['vs_2:4+int8_int8_activations']:5.2f}x 2:4+int8 a8" if name in INT4 else ""
                print(f"{threads}t {tokens:4d} tok  {name:28s} {ms[name]:8.3f} ms  {row['weight_GBps']:6.2f} GB/s  "
                      f"{row['vs_best_dense']:5.2f}x best dense  {row['vs_best_torch_quantized']:5.2f}x best torch quantized"
                      f"{vs_a8}", flush=True)
    result = {"machine": machine(), "layers": args.layers, "size": args.size, "rounds": args.rounds, "isa": isa,
              "relative_error": errors,
              "bytes_per_pass": nbytes, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
