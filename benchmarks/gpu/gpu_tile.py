"""The tile experiment: can ``torch._sparse_semi_structured_tile`` stand in for ``torch._cslt_compress`` here?

    python benchmarks/gpu/gpu_tile.py --out benchmarks/results/gpu_tile.json   # one GPU (never timed yet)
    python benchmarks/gpu/gpu_tile.py --quick --out /tmp/gpu_tile.json         # three shapes

One call of the tile op (``use_cutlass=False``) gives a 2:4 weight compressed for cuSPARSELt in both
orientations (``packed`` for the forward GEMM, ``packed_t`` for the input gradient's); the training op
today calls ``torch._cslt_compress`` twice per weight and step. For every weight shape (bf16, both
dims multiples of 128, which the op's cuSPARSELt format requires), every 2:4 mask kind
(``transposable``: 2 per row and column of every 4x4 tile, nmcompile's transposable recipe;
``rowwise``: 2:4 along the rows by magnitude, the other recipes' forward weight; ``random_rowwise``:
2 random of 4 along the rows, an MVUE-pruned gradient's pattern) and both algorithms
(``largest_abs_values_greedy``, and ``""``, the signed ranking an earlier probe used), it records:

- ``kept``: which entries the op kept (``torch._sparse_semi_structured_apply_dense`` with the op's
  bitmask): the share of the weight's non-zeros, whether it kept the weight exactly, and whether
  ``benchmarks/gpu/tile_emulation.py`` predicts the same selection (share of 4x4 tiles equal, per tie order);
- ``layout`` / ``layout_t``: the op's buffers against ``_cslt_compress`` of the matrix the op kept
  (and of its transpose): sizes, and the values region (the first rows*cols/2 elements) and the
  metadata region (the rest, rows*cols/16 16-bit words) compared bit for bit, as per-row multisets,
  and against a plain row-major compaction of the kept values (the storage split is
  ``MetadataCuSparseLt::create_compressed_representation`` in PyTorch's
  ``aten/src/ATen/native/sparse/cuda/SparseSemiStructuredTile.cu``: values, then metadata);
- ``products``: ``_cslt_sparse_mm`` of each buffer (the op's and ``_cslt_compress``'s) against the
  float32 dense product: forward ``x @ W^T`` with ``packed``, input gradient ``g @ W`` with
  ``packed_t``, each with ``transpose_result`` False and True; the relative error (max |error| over
  max |reference|) against the kept matrix and against the weight itself;

then, for the transposable mask and ``largest_abs_values_greedy``, the GPU time of the tile op
against ``_cslt_compress(w)`` plus ``_cslt_compress(w.t().contiguous())``, each captured in a CUDA
graph and replayed (alternately, median of three). Without CUDA it says so, writes a JSON saying
that nothing was measured, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu import tile_emulation as emu  # noqa: E402
from benchmarks.toolbox import RESULTS, gpu_env, graph_ms, short_error  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (4096, 1024), (1024, 4096), (3072, 768), (768, 3072)]
QUICK_SHAPES = [(4096, 4096), (11008, 4096), (3072, 768)]
ALGORITHMS = ("largest_abs_values_greedy", "")
MASKS = ("transposable", "rowwise", "random_rowwise")
#: a product within this relative error of the float32 reference is right (bf16 output rounding is about 4e-3)
TOLERANCE = 2e-2


def _bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit elements as int16 (bit-for-bit comparison: -0.0 and NaN payloads count)."""
    return t.contiguous().reshape(-1).view(torch.int16)


def masked(kind: str, w: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    if kind == "transposable":
        return emu.transposable_24(w)
    if kind == "rowwise":
        return emu.rowwise_24(w)
    return emu.random_rowwise_24(w, gen)


def compaction(kept: torch.Tensor, selected: torch.Tensor) -> torch.Tensor | None:
    """Row-major values ``[rows, cols/2]`` of the selected entries, where every group of 4 along the
    rows has exactly 2 selected; else None (a position would have to be guessed)."""
    rows, cols = kept.shape
    if not bool((selected.reshape(rows, -1, 4).sum(-1) == 2).all()):
        return None
    return kept[selected].reshape(rows, cols // 2)


def compare_buffers(tile: torch.Tensor, ref: torch.Tensor, rows: int, cols: int, row_major: torch.Tensor | None) -> dict:
    """The tile op's buffer against ``_cslt_compress``'s, for a ``[rows, cols]`` matrix."""
    out = {"shapes": [list(tile.shape), list(ref.shape)], "numel": [tile.numel(), ref.numel()],
           "expected_numel": rows * cols // 2 + rows * cols // 16}
    half = rows * cols // 2
    if tile.numel() != ref.numel() or tile.numel() < half:
        out["same_size"] = False
        return out
    out["same_size"] = True
    tile_flat, ref_flat = tile.reshape(-1), ref.reshape(-1)
    tv, rv, tm, rm = tile_flat[:half], ref_flat[:half], tile_flat[half:], ref_flat[half:]
    same_values = _bits(tv) == _bits(rv)
    out["values_equal"] = bool(same_values.all())
    out["values_equal_share"] = round(float(same_values.float().mean()), 6)
    per_row = [v.float().reshape(rows, cols // 2).sort(dim=1).values for v in (tv, rv)]
    out["values_same_per_row"] = bool(torch.equal(*per_row))
    if row_major is not None:
        out["values_row_major"] = {"tile": bool(torch.equal(_bits(tv), _bits(row_major))),
                                   "cslt": bool(torch.equal(_bits(rv), _bits(row_major)))}
    same_meta = _bits(tm) == _bits(rm)
    out["meta_numel"] = tm.numel()
    out["meta_equal"] = bool(same_meta.all())
    out["meta_equal_share"] = round(float(same_meta.float().mean()), 6)
    return out


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def products(buffers: dict, kept: torch.Tensor, w: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> dict:
    """``_cslt_sparse_mm`` of each (forward, input-gradient) buffer pair against the dense products."""
    refs = {
        "forward": (x.float() @ kept.float().t(), x.float() @ w.float().t()),  # [tokens, out]
        "input_grad": (g.float() @ kept.float(), g.float() @ w.float()),  # [tokens, in]
    }
    out = {}
    for source, (packed, packed_t) in buffers.items():
        for gemm, buf, dense in (("forward", packed, x), ("input_grad", packed_t, g)):
            for transpose_result in (False, True):
                name = f"{source} {gemm}" + (" transpose_result" if transpose_result else "")
                try:
                    got = torch._cslt_sparse_mm(buf, dense.t(), transpose_result=transpose_result)
                    got = got if transpose_result else got.t()
                    vs_kept, vs_w = (relative_error(got, ref) for ref in refs[gemm])
                    out[name] = {"vs_kept": round(vs_kept, 6), "vs_weight": round(vs_w, 6),
                                 "right": vs_kept <= TOLERANCE}
                except Exception as exc:  # the experiment's answer: recorded, the other products still run
                    out[name] = {"error": short_error(exc), "right": False}
    return out


def as_shape_of(buf: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The tile op's 1-D storage in ``_cslt_compress``'s shape where the sizes match (PyTorch's own
    ``prune_dense_static_sort`` views it as ``[rows, -1]`` too); unchanged otherwise."""
    return buf.reshape(ref.shape) if buf.numel() == ref.numel() else buf


def selection_match(selected: torch.Tensor, w: torch.Tensor, algorithm: str) -> dict:
    """Share of 4x4 tiles whose selection the emulation predicts exactly, per tie order; and with
    ``_nonzero``, whose kept non-zeros it predicts (which zeros fill a tile depends on the order the
    sorting network gives equal keys, which is not emulated)."""
    rows, cols = w.shape
    nonzero = w != 0
    out = {}
    for ties in emu.TIES:
        predicted = emu.tile_keep(w, algorithm, ties=ties)
        for suffix, a, b in (("", predicted, selected), ("_nonzero", predicted & nonzero, selected & nonzero)):
            same = (a == b).reshape(rows // 4, 4, cols // 4, 4).all(3).all(1)
            out[ties + suffix] = round(float(same.float().mean()), 6)
    return out


def one_case(w: torch.Tensor, kind: str, algorithm: str, x: torch.Tensor, g: torch.Tensor) -> dict:
    rows, cols = w.shape
    row = {"weight": [rows, cols], "mask": kind, "algorithm": algorithm or '""'}
    try:
        packed, _, packed_t, _, bitmask = torch._sparse_semi_structured_tile(w, algorithm, False)
        kept = torch._sparse_semi_structured_apply_dense(w, bitmask)
        selected = torch._sparse_semi_structured_apply_dense(torch.ones_like(w), bitmask) != 0
    except Exception as exc:
        row["error"] = short_error(exc)
        return row
    nonzero = int((w != 0).sum())
    row["kept"] = {"share": round(int(((kept != 0) & (w != 0)).sum()) / max(nonzero, 1), 6),
                   "exactly": bool(torch.equal(_bits(kept), _bits(w))),
                   "selected_per_tile_min": int(selected.reshape(rows // 4, 4, cols // 4, 4).sum((1, 3)).min()),
                   "emulation_tiles_equal": selection_match(selected, w, algorithm)}
    kept_t = kept.t().contiguous()
    ref, ref_t = torch._cslt_compress(kept), torch._cslt_compress(kept_t)
    row["layout"] = compare_buffers(packed, ref, rows, cols, compaction(kept, selected))
    row["layout_t"] = compare_buffers(packed_t, ref_t, cols, rows, compaction(kept_t, selected.t()))
    buffers = {"tile": (as_shape_of(packed, ref), as_shape_of(packed_t, ref_t)), "cslt_compress": (ref, ref_t)}
    row["products"] = products(buffers, kept, w, x, g)
    row["tile_products_right"] = all(p["right"] for name, p in row["products"].items() if name.startswith("tile"))
    return row


def tile_rows(shapes, device: str = "cuda", tokens: int = 256, masks=MASKS, algorithms=ALGORITHMS,
              on_shape=None) -> list[dict]:
    """Every case of every shape; ``on_shape(rows so far)`` after each shape (to save them)."""
    rows = []
    for out_f, in_f in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        base = torch.randn(out_f, in_f, device=device, generator=gen).to(torch.bfloat16)
        x = torch.randn(tokens, in_f, device=device, generator=gen).to(torch.bfloat16)
        g = torch.randn(tokens, out_f, device=device, generator=gen).to(torch.bfloat16)
        for kind in masks:
            w = masked(kind, base, gen).contiguous()
            for algorithm in algorithms:
                started = time.monotonic()
                rows.append(one_case(w, kind, algorithm, x, g))
                rows[-1]["seconds"] = round(time.monotonic() - started, 2)
                print(line(rows[-1]), flush=True)
        del base, x, g
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(rows)
    return rows


def timing_rows(shapes, rounds: int = 3) -> list[dict]:
    rows = []
    for out_f, in_f in shapes:
        torch.manual_seed(0)
        w = emu.transposable_24(torch.randn(out_f, in_f, device="cuda").to(torch.bfloat16)).contiguous()
        fns = {
            "tile_ms": lambda: torch._sparse_semi_structured_tile(w, ALGORITHMS[0], False),
            "cslt_compress_both_ms": lambda: (torch._cslt_compress(w), torch._cslt_compress(w.t().contiguous())),
            "cslt_compress_one_ms": lambda: torch._cslt_compress(w),
        }
        times, how = {name: [] for name in fns}, {}
        for _ in range(rounds):
            for name, fn in fns.items():
                try:
                    ms, how[name] = graph_ms(fn)
                    times[name].append(ms)
                except Exception as exc:
                    how[name] = short_error(exc)
        row = {"weight": [out_f, in_f], **{k: round(statistics.median(v), 4) if v else None for k, v in times.items()},
               "timed": how}
        rows.append(row)
        print(f"timing {out_f}x{in_f}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("_ms")), flush=True)
    return rows


def _err(products: dict, name: str) -> str:
    p = products.get(name, {})
    return "error" if "error" in p else f"{p.get('vs_kept', float('nan')):.3g}"


def line(row: dict) -> str:
    head = f"{row['weight'][0]}x{row['weight'][1]} {row['mask']:<15}{row['algorithm']:<27}"
    if "error" in row:
        return head + row["error"]
    lay, lay_t, prod = row["layout"], row["layout_t"], row["products"]
    return (head + f"kept {row['kept']['share']:.3f} exact {row['kept']['exactly']!s:<6}"
            f"values {lay.get('values_equal')!s:<6}/{lay_t.get('values_equal')!s:<6}"
            f"meta {lay.get('meta_equal')!s:<6}/{lay_t.get('meta_equal')!s:<6}"
            f"tile fwd {_err(prod, 'tile forward transpose_result')} dgrad {_err(prod, 'tile input_grad transpose_result')} "
            f"cslt fwd {_err(prod, 'cslt_compress forward transpose_result')}")


def markdown(result: dict) -> str:
    lines = [" | ".join(f"{k}: {v}" for k, v in result.get("env", {}).items()), "",
             "| weight | mask | algorithm | kept share | kept exactly | emulation tiles equal, non-zeros (last/first) | values equal (W / W^T) "
             "| meta equal (W / W^T) | tile fwd err | tile dgrad err | cslt fwd err | tile products right |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("cases", []):
        if "error" in r:
            lines.append(f"| {r['weight']} | {r['mask']} | {r['algorithm']} | {r['error'].replace('|', '/')} |" + " |" * 8)
            continue
        tiles, lay, lay_t, prod = r["kept"]["emulation_tiles_equal"], r["layout"], r["layout_t"], r["products"]
        lines.append(
            f"| {r['weight'][0]}x{r['weight'][1]} | {r['mask']} | {r['algorithm']} | {r['kept']['share']:.4f} | "
            f"{r['kept']['exactly']} | {tiles.get('last_nonzero')}/{tiles.get('first_nonzero')} | {lay.get('values_equal')} / {lay_t.get('values_equal')} | "
            f"{lay.get('meta_equal')} / {lay_t.get('meta_equal')} | {_err(prod, 'tile forward transpose_result')} | "
            f"{_err(prod, 'tile input_grad transpose_result')} | {_err(prod, 'cslt_compress forward transpose_result')} | "
            f"{r['tile_products_right']} |")
    if result.get("timing"):
        lines += ["", "| weight | tile op ms | _cslt_compress W and W^T ms | _cslt_compress W ms | timed |", "|---|---|---|---|---|"]
        for r in result["timing"]:
            lines.append(f"| {r['weight'][0]}x{r['weight'][1]} | {r['tile_ms']} | {r['cslt_compress_both_ms']} | "
                         f"{r['cslt_compress_one_ms']} | {', '.join(sorted(set(r['timed'].values())))} |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "gpu_tile.json"))
    parser.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES} only")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        message = "gpu_tile: no CUDA GPU here (torch.cuda.is_available() is False); nothing measured"
        print(message)
        out.write_text(json.dumps({"torch": torch.__version__, "skipped": message}, indent=1))
        return 0
    shapes = QUICK_SHAPES if args.quick else SHAPES
    result = {"env": gpu_env(), "tokens": args.tokens, "tolerance": TOLERANCE}
    print(" | ".join(f"{k}: {v}" for k, v in result["env"].items()), flush=True)
    started = time.monotonic()
    def save(rows):  # after each shape: a timeout later keeps what was answered
        out.write_text(json.dumps({**result, "cases": rows}, indent=1))

    try:
        result["cases"] = tile_rows(shapes, "cuda", args.tokens, on_shape=save)
    except Exception as exc:  # e.g. out of memory: what ran is kept in the printed lines
        result["cases_error"] = short_error(exc)
        print(result["cases_error"], flush=True)
    out.write_text(json.dumps(result, indent=1))  # the answers first: a failed capture below cannot lose them
    if not args.no_timing:
        try:
            result["timing"] = timing_rows(shapes)
        except Exception as exc:
            result["timing_error"] = short_error(exc)
            print(result["timing_error"], flush=True)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
