"""Llama-shaped models of real size on this CPU: dense against 2:4 packed, end to end, against the bytes bound.

The models are Hugging Face directories written by ``benchmarks/models/make_models.py`` (random bf16 weights,
loaded by ``transformers.AutoModelForCausalLM.from_pretrained``, nothing downloaded):

    python benchmarks/models/make_models.py --shape 1b --out /work/models/llama-1b          # once (about 30 s)
    python benchmarks/models/real_scale.py --shape 1b --out benchmarks/results/real_scale_1b.json
    python benchmarks/models/real_scale.py --shape 1b --only decode --new-tokens 8 --runs 1  # a quick check
    python benchmarks/models/real_scale.py --shape tiny --out /tmp/tiny.json                 # everything, 2-layer model
    python benchmarks/models/real_scale.py --render benchmarks/results/real_scale_1b.json    # tables for docs/benchmarks.md

``--model DIR`` defaults to ``/work/models/llama-SHAPE``; ``--shape tiny`` writes a tiny one into a
temporary folder when no ``--model`` is given. ``--only`` picks parts (default: all three); with
``--out`` naming an existing file of the same shape, the parts run now replace theirs in it.

  decode     per dtype (fp32, bf16): greedy ``generate`` of ``--new-tokens`` (64) after a
             ``--prompt``-token (128) random prompt, batch 1, with its KV cache. Variants: dense eager
             and compiled (Inductor), 2:4 packed compiled (``backend="nmsparse"``), each at every
             ``--threads`` count (1 and 2; a compiled variant is compiled at its own count,
             ``cpp.threads``). Each variant's first call (compiles) is timed on its own; then all are
             timed round-robin (``toolbox.interleaved``, ``--runs`` rounds, medians). A
             streamer stamps every token, so a call splits into its prefill (prompt + first token)
             and its decode steps; tok/s is decode steps per second, end-to-end tok/s (new tokens /
             whole call) beside it. A variant whose median decode step in its first call is
             ``--slow`` (3) times the fastest of its group or more (bf16 compiled by Inductor on
             AVX2), and whose rounds would take over 2 minutes, is not timed again: its figure is
             that first call's, marked so.
             Dense and 2:4 are timed in one process, interleaved, where both fit in ``--max-gb``
             (default 90% of the memory available at start); else one after the other ("apart").
             The 2:4 model: :func:`load_24`: a deployed 2:4 directory beside the dense one
             (``DIR-24``, written by ``nmcompile prune`` or ``make_models.py --nm 2:4``) loaded
             straight into packed weights by ``nmcompile.deploy.load_pretrained(DIR-24, packed=True)``;
             without one, the dense directory loaded, then block by block every decoder linear pruned
             2:4 by magnitude, ``finalize(block, pattern="2:4")``, ``pack_weights``.
             The bound: the weight bytes a dense token reads over those a 2:4 token reads, counted
             from the models (every weight once; of an embedding that is not also the output head,
             one row), with the expected value from the shapes (2:4 weights at 0.53125x in fp32,
             0.5625x in bf16, everything else dense). The 2:4 model's bytes per token x its tok/s
             is judged against a read-bandwidth probe (``toolbox.bandwidth``) taken before,
             between the models and after.
  firstcall  per dtype, at the machine's thread count: a fresh process loads the model, makes it
             ready (2:4: prune, finalize, pack with the dispatch timing) and runs ``generate`` twice;
             the first call = ready + first generate. Each kind runs in a first and then a second
             process sharing a fresh ``NMCOMPILE_CACHE_DIR`` (cached dispatch decisions) and a fresh
             ``TORCHINDUCTOR_CACHE_DIR`` per kind (its compiled graphs). The processes' resident
             memory after the calls is recorded too.
  prune      ``nmcompile prune DIR --recipe sparsegpt:2:4`` (the CLI, in a subprocess) on
             ``--calib-samples`` (64) windows of ``--calib-len`` (512) random token ids (a ``.pt``
             file made here), one pass and ``--sequential``: wall time and peak resident memory
             (the process's ``VmHWM``). The command loads the model in its stored dtype (the solve runs in
             float32 per weight) and writes its output (removed after); the wall time includes both.

Targets (printed by ``--render``): 2:4 decode at >= 90% of the bytes bound against the best dense of
the same dtype; 2:4 streaming at >= 75% of the measured read bandwidth; resident parameters within
0.02 of the expected ratio; the first call of 2:4 <= 1.5x dense's in a first process and <= dense's
+ 10 s in a second.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.models import make_models  # noqa: E402
from benchmarks.toolbox import ROOT, bandwidth, busy_loop, interleaved, machine, peak_mb, resident_mb  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: bytes of a packed 2:4 weight over its dense bytes: half the values plus one bit (fp32) or two bits
#: (bf16, fp16) per dense element
PACKED_FRACTION = {torch.float32: 0.5 + 1 / 32, torch.bfloat16: 0.5 + 1 / 16, torch.float16: 0.5 + 1 / 16}
PARTS = ("decode", "firstcall", "prune")
THREADS = torch.get_num_threads()  # the machine's default, restored after each timed group
#: a variant ``--slow`` times slower than the fastest is left out of the rounds only if they would take this long
SLOW_SECONDS = 120.0


# ----------------------------------------------------------------------------- models


def default_dir(shape: str) -> str:
    return f"/work/models/llama-{shape}"


def load_dense(path: str, dtype: torch.dtype) -> nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval().requires_grad_(False)


def decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers of the decoder blocks (attention and MLP projections; not the output head)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name]


def load_24(path: str, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    """The 2:4 model the benchmark runs, and how long each step took.

    Today: the dense directory loaded, then block by block every decoder linear pruned 2:4 by
    magnitude (into a new tensor), ``nmcompile.finalize(block, pattern="2:4")`` (records them) and
    ``nmcompile.deploy.pack_weights(block)`` (packed-only weights; each shape's token range timed
    against dense once: the dispatch), so that one block's pruned dense weights exist at a time. The
    embedding and the output head, tied or not, stay dense. The one place to switch to a loader of
    pruned directories (``nmcompile.deploy.load_pretrained(path, packed=True)``) once it lands.
    """
    import nmcompile
    from nmcompile.deploy import load_pretrained, pack_weights

    start = time.perf_counter()
    pruned = path.rstrip("/") + "-24"
    if os.path.isfile(os.path.join(pruned, "nmcompile.json")):  # the user's route: a deployed directory, packed
        model = load_pretrained(pruned, packed=True, dtype=dtype)
        release()
        from nmcompile.kernels.dispatch import DECISION_ATTR

        params = [p for p in model.parameters() if hasattr(p, "nbytes_packed")]
        decisions = [getattr(p, DECISION_ATTR) for p in params]
        return model, {"load_s": time.perf_counter() - start, "prune_s": 0.0, "pack_s": 0.0, "from": pruned,
                       "finalized": len(params), "packed": len(params), "not_packed": {},
                       "ranges": sorted({d.token_range for d in decisions}),
                       "left_dense": [n for n, p in model.named_parameters() if p.dim() >= 2
                                      and not hasattr(p, "nbytes_packed")]}
    model = load_dense(path, dtype)
    loaded = time.perf_counter()
    blocks: dict[str, list[nn.Linear]] = {}
    for name, m in decoder_linears(model):
        blocks.setdefault(name.rsplit(".layers.", 1)[0] + ".layers." + name.rsplit(".layers.", 1)[1].split(".")[0],
                          []).append(m)
    prune_s = pack_s = 0.0
    finalized, decisions = 0, {}
    for prefix, linears in blocks.items():
        t0 = time.perf_counter()
        with torch.no_grad():
            for m in linears:  # a new tensor: the loaded weight may be a view of a mapped shard
                m.weight = nn.Parameter(nmcompile.masks.prune(m.weight, 2, 4, 1), requires_grad=False)
        block = model.get_submodule(prefix)
        finalized += len(nmcompile.finalize(block, pattern="2:4"))
        t1 = time.perf_counter()
        decisions.update({f"{prefix}.{k}": d for k, d in pack_weights(block).items()})
        prune_s, pack_s = prune_s + t1 - t0, pack_s + time.perf_counter() - t1
    before = resident_mb()
    with torch.no_grad():  # the weights left dense (embedding, norms) into memory of their own: loaded
        for p in model.parameters():  # from bf16 files they are views of the mapped shards
            if not hasattr(p, "nbytes_packed"):
                p.data = p.data.clone()
    release()  # the dense weights pack_weights replaced below malloc's mmap threshold
    info = {"load_s": loaded - start, "prune_s": prune_s, "pack_s": pack_s, "rss_mb_freed": before - resident_mb(),
            "finalized": finalized,
            "left_dense": [n for n, p in model.named_parameters() if p.dim() >= 2 and not hasattr(p, "nbytes_packed")],
            "packed": sum(d.kernel == "cpu24" for d in decisions.values()),
            "not_packed": {k: d.reason for k, d in decisions.items() if d.kernel != "cpu24"},
            "ranges": sorted({d.token_range for d in decisions.values() if d.kernel == "cpu24"})}
    return model, info


def release() -> None:
    """Collect garbage and hand the C heap's free pages back to the system: a freed tensor below
    glibc's mmap threshold (up to 32 MB: most weights here) stays resident otherwise."""
    from nmcompile.state.memory import trim_heap

    gc.collect()
    trim_heap()


def meta_model(path, dtype: torch.dtype) -> nn.Module:
    """The dense model's structure, on the meta device (no memory): for byte counts before loading.
    ``path``: a model directory, or its ``transformers`` config."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True) if isinstance(path, (str, os.PathLike)) else path
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _bytes(p: torch.Tensor) -> int:
    packed = getattr(p, "nbytes_packed", None)
    return packed if packed is not None else p.numel() * p.element_size()


def weight_bytes(model: nn.Module) -> dict:
    """``resident``: bytes of every parameter (packed ones as packed, tied ones once; a plain one as
    its whole storage, so that a view into a larger buffer shows); ``per_token``: the bytes one decoded
    token reads: every weight once, of an embedding that is not also a linear weight one row."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    resident = per_token = 0
    storages = set()
    for p in model.parameters():  # each parameter object once
        n = _bytes(p)
        if hasattr(p, "nbytes_packed") or p.is_meta:
            resident += n
        else:
            key = p.untyped_storage().data_ptr()
            if key not in storages:
                storages.add(key)
                resident += p.untyped_storage().nbytes()
        per_token += p.shape[-1] * p.element_size() if id(p) in embeddings and id(p) not in linears else n
    return {"resident": resident, "per_token": per_token}


def expected_24(dense: nn.Module, dtype: torch.dtype) -> dict:
    """The 2:4 model's bytes expected from the dense one's shapes: decoder linears packed, the rest dense."""
    counts = weight_bytes(dense)
    saved = sum(_bytes(m.weight) for _, m in decoder_linears(dense)) * (1 - PACKED_FRACTION[dtype])
    return {"resident": counts["resident"] - saved, "per_token": counts["per_token"] - saved}


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("inf")


def tokenizer_size(path: str) -> int:
    import transformers

    return len(transformers.AutoTokenizer.from_pretrained(path, local_files_only=True))


def prompt_ids(path: str, length: int, seed: int = 0) -> torch.Tensor:
    """A random prompt of ``length`` ids the tokenizer knows (its special tokens left out)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, tokenizer_size(path), (1, length), generator=g)


# ----------------------------------------------------------------------------- timing one generate


def _streamer_class():
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Stamps the prompt and every generated token as ``generate`` hands them over."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    return Clock


def generate_timed(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> dict:
    """One greedy ``generate``: whole-call, prefill (prompt + first token) and decode-step times."""
    clock = _streamer_class()()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id,
                             streamer=clock)
    total = time.perf_counter() - start
    stamps = clock.times[1:]  # [0] is the prompt, then one per new token
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"total_s": total, "prefill_s": stamps[0] - start if stamps else math.nan,
            "decode_s": sum(steps) / len(steps) if steps else math.nan,
            "median_step_s": statistics.median(steps) if steps else math.nan,
            "tokens": out[0, ids.shape[1]:].tolist()}


class Variant:
    """One way of running one model: eager or compiled, at a thread count."""

    def __init__(self, kind: str, mode: str, threads: int, model: nn.Module, forward):
        self.kind, self.mode, self.threads, self.model, self.forward = kind, mode, threads, model, forward
        self.name = f"{kind} {mode} {threads}t"
        self.calls: list[dict] = []
        self.first: dict | None = None
        self.slow = False

    def __call__(self, ids, new_tokens):
        torch.set_num_threads(self.threads)
        self.model.forward = self.forward  # eager: the bound method; compiled: its compiled wrapper
        return generate_timed(self.model, ids, new_tokens)


def variants_of(kind: str, model: nn.Module, modes, threads) -> list[Variant]:
    eager = model.forward
    out = []
    for mode in modes:
        for t in threads:
            if mode == "eager":
                forward = eager
            elif kind == "dense":
                forward = torch.compile(eager, options={"cpp.threads": t})
            else:
                forward = torch.compile(eager, backend="nmsparse", options={"cpp.threads": t})
            out.append(Variant(kind, mode, t, model, forward))
    return out


def time_group(variants: list[Variant], ids, new_tokens: int, runs: int, slow: float) -> None:
    """First calls (compiles), then round-robin rounds of the variants that are not ``slow``."""
    for v in variants:
        v.first = v(ids, new_tokens)
        print(f"  {v.name}: first call {v.first['total_s']:.1f} s (prefill {v.first['prefill_s']:.1f} s, median step "
              f"{v.first['median_step_s'] * 1e3:.0f} ms)", flush=True)
    fastest = min(v.first["median_step_s"] for v in variants)
    for v in variants:  # slow, and its rounds would take minutes: not noise on a busy machine
        step = v.first["median_step_s"]
        v.slow = step > slow * fastest and step * new_tokens * runs > SLOW_SECONDS
    timed = {v.name: (lambda v=v: v.calls.append(v(ids, new_tokens))) for v in variants if not v.slow}
    if timed and runs:
        interleaved(timed, budget=0.0, min_reps=runs, max_reps=runs, warm=False)
    torch.set_num_threads(THREADS)


def summary(v: Variant, new_tokens: int) -> dict:
    if v.calls:
        decode = statistics.median(c["decode_s"] for c in v.calls)
        total = statistics.median(c["total_s"] for c in v.calls)
        prefill = statistics.median(c["prefill_s"] for c in v.calls)
        timed = f"interleaved, median of {len(v.calls)}"
    else:  # slow, or --runs 0: the first call's decode steps (its prefill compiled)
        decode, total, prefill = v.first["median_step_s"], math.nan, math.nan
        timed = "first call only (median step)" + (": slow" if v.slow else "")
    return {"kind": v.kind, "mode": v.mode, "threads": v.threads, "first_call_s": v.first["total_s"],
            "prefill_s": prefill, "decode_ms": decode * 1e3, "decode_tok_s": 1 / decode,
            "end_to_end_tok_s": new_tokens / total if total == total else math.nan, "timed": timed}


# ----------------------------------------------------------------------------- decode


def decode(path: str, dtypes, threads, new_tokens: int, prompt: int, runs: int, slow: float, max_gb: float,
           sparse_modes=("compiled",), dense_modes=("eager", "compiled")) -> list[dict]:
    torch._dynamo.config.recompile_limit = 64  # every variant compiles its own graphs of the same code
    ids = prompt_ids(path, prompt)
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        meta = meta_model(path, dtype)
        dense_counts, expected = weight_bytes(meta), expected_24(meta, dtype)
        del meta
        dense_gb, sparse_gb = dense_counts["resident"] / 1e9, expected["resident"] / 1e9
        margin = 1.0 + 0.1 * dense_gb  # activations, compiled code, the KV cache, the allocator
        together = dense_gb + sparse_gb + margin <= max_gb
        row = {"dtype": dname, "new_tokens": new_tokens, "prompt": prompt, "threads": list(threads),
               "timing": "interleaved" if together else "apart", "bandwidth_gbps": [bandwidth()],
               "rss_mb": {"start": resident_mb()}, "skipped": {}}
        print(f"{dname}: dense {dense_gb:.2f} GB, 2:4 {sparse_gb:.2f} GB expected, budget {max_gb:.1f} GB: "
              f"{row['timing']}", flush=True)
        sparse_vs, dense_vs, sparse_model, dense_model = [], [], None, None
        if dense_gb + margin > max_gb:  # making the 2:4 model loads the dense one too
            row["skipped"]["dense and 2:4"] = f"the dense model ({dense_gb:.1f} GB) does not fit in --max-gb {max_gb:.1f}"
        else:
            # 2:4 first: it is made from a dense load, freed before the dense model is loaded
            sparse_model, row["build"] = load_24(path, dtype)
            row["rss_mb"]["after 2:4 model"] = resident_mb()
            row["bytes_24"] = weight_bytes(sparse_model)
            b = row["build"]
            print(f"  2:4 model: load {b['load_s']:.1f} s, prune {b['prune_s']:.1f} s, pack {b['pack_s']:.1f} s, "
                  f"{b['packed']} layers packed, ranges {b['ranges']}", flush=True)
            sparse_vs = variants_of("2:4", sparse_model, sparse_modes, threads)
            if not together:  # apart: time the 2:4 model, free it, then load the dense one
                time_group(sparse_vs, ids, new_tokens, runs, slow)
                # load + compile + decode, before the read probe's 512 MB buffer
                row["rss_mb"]["peak with the 2:4 model alone"] = peak_mb()
                row["bandwidth_gbps"].append(bandwidth())
                for v in sparse_vs:
                    v.model = v.forward = None
                sparse_model = None
                torch._dynamo.reset()
                release()
                row["rss_mb"]["after freeing the 2:4 model"] = resident_mb()
            dense_model = load_dense(path, dtype)
            row["rss_mb"]["after dense model"] = resident_mb()
            row["bytes_dense"] = weight_bytes(dense_model)
            dense_vs = variants_of("dense", dense_model, dense_modes, threads)
            time_group(sparse_vs + dense_vs if together else dense_vs, ids, new_tokens, runs, slow)
            row["bandwidth_gbps"].append(bandwidth())
        row["bytes_dense"] = row.get("bytes_dense", dense_counts)
        row["rss_mb"]["peak"] = peak_mb()
        every = sparse_vs + dense_vs
        row["variants"] = {v.name: summary(v, new_tokens) for v in every}
        for kind in ("dense", "2:4"):
            outs = {v.name: v.first["tokens"] for v in every if v.kind == kind}
            if outs:
                first = next(iter(outs.values()))
                row[f"same tokens {kind}"] = {k: o == first for k, o in outs.items()}
        row["expected_24"] = expected
        finish(row)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "variants"}, indent=1, default=str), flush=True)
        for name, s in row["variants"].items():
            print(f"  {name:>22}: {s['decode_tok_s']:7.2f} tok/s decode, {s['end_to_end_tok_s']:7.2f} end to end, "
                  f"first call {s['first_call_s']:.1f} s ({s['timed']})", flush=True)
        del every, sparse_vs, dense_vs, sparse_model, dense_model
        torch._dynamo.reset()
        release()
    return rows


def finish(row: dict) -> None:
    """Best dense, best 2:4, the bound, GB/s and the resident ratio of one dtype's row."""
    variants = row["variants"]
    best = {}
    for kind in ("dense", "2:4"):
        mine = {k: v for k, v in variants.items() if v["kind"] == kind}
        if mine:
            best[kind] = max(mine, key=lambda k: mine[k]["decode_tok_s"])
    row["best"] = best
    dense_pt, sparse_pt = row["bytes_dense"]["per_token"], row.get("bytes_24", {}).get("per_token")
    row["bound"] = dense_pt / sparse_pt if sparse_pt else None
    row["bound_expected"] = dense_pt / row["expected_24"]["per_token"]
    row["bandwidth_peak_gbps"] = max(row["bandwidth_gbps"])
    if sparse_pt:
        row["resident_ratio"] = row["bytes_24"]["resident"] / row["bytes_dense"]["resident"]
        row["resident_ratio_expected"] = row["expected_24"]["resident"] / row["bytes_dense"]["resident"]
    if "2:4" in best:
        row["gbps_24"] = sparse_pt * variants[best["2:4"]]["decode_tok_s"] / 1e9
    if "dense" in best:
        row["gbps_dense"] = dense_pt * variants[best["dense"]]["decode_tok_s"] / 1e9
    if len(best) == 2:
        row["speedup"] = variants[best["2:4"]]["decode_tok_s"] / variants[best["dense"]]["decode_tok_s"]
        e2e = {kind: max((v["end_to_end_tok_s"] for v in variants.values() if v["kind"] == kind
                          and v["end_to_end_tok_s"] == v["end_to_end_tok_s"]), default=math.nan) for kind in best}
        row["speedup_end_to_end"] = e2e["2:4"] / e2e["dense"]


# ----------------------------------------------------------------------------- first call, in fresh processes

FIRSTCALL_CHILD = "firstcall-child"


def firstcall_child(path: str, kind: str, dname: str, new_tokens: int, prompt: int) -> dict:
    """In a fresh process: load, make ready, compile and generate twice; the timings as a dict."""
    from nmcompile.kernels import cpu24

    cpu24.status()  # the kernel library loads (built once per machine; not what is measured)
    dtype = DTYPES[dname]
    ids = prompt_ids(path, prompt)
    base = resident_mb()
    start = time.perf_counter()
    if kind == "dense":
        model, info = load_dense(path, dtype), {}
        ready = time.perf_counter()
        info["load_s"] = ready - start
        model.forward = torch.compile(model.forward)
    else:
        model, info = load_24(path, dtype)
        ready = time.perf_counter()
        model.forward = torch.compile(model.forward, backend="nmsparse")
    first = generate_timed(model, ids, new_tokens)
    second = generate_timed(model, ids, new_tokens)
    prepare = info.get("pack_s", 0.0)  # what makes a loaded model ready: 2:4's packing and dispatch timing
    return {"kind": kind, "dtype": dname, "threads": torch.get_num_threads(), **{k: v for k, v in info.items() if k.endswith("_s")},
            "prepare_s": prepare, "first_generate_s": first["total_s"], "second_generate_s": second["total_s"],
            "first_call_s": prepare + first["total_s"], "overhead_s": prepare + first["total_s"] - second["total_s"],
            "rss_mb": {"before load": base, "after": resident_mb(), "peak": peak_mb()},
            "same tokens twice": first["tokens"] == second["tokens"], "from start s": time.perf_counter() - start}


def firstcall(path: str, dtypes, new_tokens: int, prompt: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="real_scale_firstcall_")
    out = {"cache dir": "fresh per run: NMCOMPILE_CACHE_DIR shared by all processes, TORCHINDUCTOR_CACHE_DIR per kind and dtype",
           "runs": []}
    try:
        for dname in dtypes:
            for process in ("first", "second"):
                for kind in ("dense", "2:4"):
                    env = dict(os.environ, NMCOMPILE_CACHE_DIR=os.path.join(tmp, "nmcompile"),
                               TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, f"inductor-{kind.replace(':', '')}-{dname}"))
                    cmd = [sys.executable, __file__, "--" + FIRSTCALL_CHILD, kind, dname, "--model", path,
                           "--new-tokens", str(new_tokens), "--prompt", str(prompt)]
                    start = time.perf_counter()
                    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    wall = time.perf_counter() - start
                    if done.returncode:
                        raise RuntimeError(f"first-call child {kind} {dname} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    result.update(process=process, wall_s=wall)
                    out["runs"].append(result)
                    print(f"  {dname} {kind} {process} process: first call {result['first_call_s']:.1f} s "
                          f"(ready {result['prepare_s']:.1f} s + generate {result['first_generate_s']:.1f} s; "
                          f"second generate {result['second_generate_s']:.1f} s), RSS {result['rss_mb']['after']:.0f} MB",
                          flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- prune

# the child samples its resident memory every 20 ms and, at each new high (50 MB above the last),
# notes where the main thread was (its innermost nmcompile/transformers/torch.save frames)
PRUNE_CHILD = """
import json, sys, threading, time, traceback
sys.path.append(sys.argv[1])  # the repository root: benchmarks.toolbox
from benchmarks.toolbox import peak_mb, resident_mb
from nmcompile.app.cli import main
main_thread = threading.main_thread().ident
high = {"mb": 0.0, "where": "", "s": 0.0}
def watch():
    while True:
        mb = resident_mb()
        if mb > high["mb"] + 50:
            frames = traceback.extract_stack(sys._current_frames()[main_thread])
            ours = [f"{f.filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{f.lineno} {f.name}"
                    for f in frames if "nmcompile" in f.filename or "transformers" in f.filename
                    or "serialization" in f.filename]
            high.update(mb=mb, where=" < ".join(reversed(ours[-4:])), s=time.perf_counter() - start)
        time.sleep(0.02)
start = time.perf_counter()
threading.Thread(target=watch, daemon=True).start()
rc = main(["prune", *sys.argv[2:]])
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - start, "peak_rss_mb": peak_mb(),
                  "peak_where": high["where"], "peak_at_s": high["s"]}))
"""


def prune_estimate_gb(path: str, sequential: bool, batch: int, seq_len: int) -> float:
    """What ``nmcompile prune`` may hold: the model in its stored dtype (bf16 here), the statistics
    (taken as twice the inputs' Gram matrices, all at once or one block's), the loss's logits (at most
    256 MB, ``prune.LOGIT_BYTES``) twice."""
    meta = meta_model(path, torch.bfloat16)
    grams = {}
    for name, m in decoder_linears(meta):
        block = name.split(".layers.")[1].split(".")[0]
        grams[block] = grams.get(block, 0) + 2 * m.in_features ** 2 * 4
    stats = max(grams.values()) if sequential else sum(grams.values())
    logits = 2 * min(batch * seq_len * meta.config.vocab_size * 4, 1 << 28)
    return (weight_bytes(meta)["resident"] + stats + logits) / 1e9


def prune(path: str, samples: int, seq_len: int, max_gb: float, recipe: str = "sparsegpt:2:4",
          modes=("one pass", "sequential")) -> dict:
    tmp = tempfile.mkdtemp(prefix="real_scale_prune_")
    out = {"recipe": recipe, "samples": samples, "seq_len": seq_len, "runs": []}
    try:
        vocab = tokenizer_size(path)
        g = torch.Generator().manual_seed(1)
        calib, held = os.path.join(tmp, "calibration.pt"), os.path.join(tmp, "held_out.pt")
        torch.save(torch.randint(2, vocab, (samples * seq_len,), generator=g), calib)
        torch.save(torch.randint(2, vocab, (2 * seq_len,), generator=g), held)
        for name in modes:
            sequential = name == "sequential"
            estimate = prune_estimate_gb(path, sequential, 8, seq_len)
            if estimate > max_gb:
                out["runs"].append({"mode": name, "skipped": f"estimated {estimate:.1f} GB, more than --max-gb {max_gb:.1f}"})
                print(f"  prune {name}: skipped, estimated {estimate:.1f} GB", flush=True)
                continue
            dest = os.path.join(tmp, "pruned")
            cmd = [sys.executable, "-c", PRUNE_CHILD, str(ROOT), path, "--recipe", recipe, "--calibration", calib,
                   "--held-out", held, "--seq-len", str(seq_len), "--samples", str(samples), "--out", dest, "--quiet"]
            cmd.append("--sequential" if sequential else "--one-pass")
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - start
            lines = done.stdout.strip().splitlines()
            if done.returncode or not lines:
                raise RuntimeError(f"nmcompile prune ({name}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            child = json.loads(lines[-1])
            run = {"mode": name, "wall_s": wall, "cli_s": child["seconds"], "peak_rss_mb": child["peak_rss_mb"],
                   "peak_where": child["peak_where"], "peak_at_s": child["peak_at_s"],
                   "rc": child["rc"], "estimate_gb": estimate, "summary": lines[:-1]}
            if child["rc"]:  # the CLI's one-line error, which a failed run is judged by
                run["error"] = done.stderr.strip()[-2000:]
            out["runs"].append(run)
            print(f"  prune {name}: {wall:.1f} s, peak RSS {run['peak_rss_mb']:.0f} MB (rc {run['rc']}) at "
                  f"{run['peak_at_s']:.0f} s in {run['peak_where']}" + (f"\n  {run['error']}" if child["rc"] else ""),
                  flush=True)
            shutil.rmtree(dest, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- render


def _f(x, fmt=".2f", none="-"):
    return none if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def ok(flag: bool) -> str:
    """A target's verdict in the tables."""
    return "met" if flag else "**missed**"


def targets(result: dict) -> list[str]:
    lines = ["| target | measured | verdict |", "| --- | --- | --- |"]

    for r in result.get("decode", []):
        d = r["dtype"]
        if r.get("speedup") is not None and r.get("bound"):
            need = 0.9 * r["bound"]
            lines.append(f"| {d}: 2:4 decode >= 90% of the bytes bound ({r['bound']:.2f}x) against the best dense, "
                         f">= {need:.2f}x | {r['speedup']:.2f}x ({r['best']['2:4']} / {r['best']['dense']}; "
                         f"{r['speedup'] / r['bound']:.0%} of the bound) | {ok(r['speedup'] >= need)} |")
        if r.get("gbps_24") is not None:
            share = r["gbps_24"] / r["bandwidth_peak_gbps"]
            lines.append(f"| {d}: 2:4 decode streams >= 75% of the read bandwidth | {r['gbps_24']:.1f} GB/s of "
                         f"{r['bandwidth_peak_gbps']:.1f} GB/s (the run's highest probe), {share:.0%} | {ok(share >= 0.75)} |")
        if r.get("resident_ratio") is not None:
            gap = abs(r["resident_ratio"] - r["resident_ratio_expected"])
            lines.append(f"| {d}: resident parameters within 0.02 of {r['resident_ratio_expected']:.3f}x | "
                         f"{r['resident_ratio']:.3f}x | {ok(gap <= 0.02)} |")
        alone = r.get("rss_mb", {}).get("peak with the 2:4 model alone")
        if result.get("shape") == "8b" and alone is not None:
            lines.append(f"| {d}: the 8B 2:4 model loads packed and decodes within {PEAK_8B_GB} GB resident | "
                         f"process peak {alone / 1024:.2f} GiB ({alone * 2**20 / 1e9:.2f} GB) before the dense model "
                         f"is loaded | {ok(alone * 2**20 <= PEAK_8B_GB * 1e9)} |")
    quiet = {r["dtype"]: r for r in result.get("decode", [])}
    for r in result.get("decode busy", []):
        d, q = r["dtype"], quiet.get(r["dtype"])
        if r.get("speedup") is not None and q is not None and q.get("speedup"):
            keep = r["speedup"] / q["speedup"]
            lines.append(f"| {d}, busy loop on one core: 2:4 / dense decode >= 80% of the quiet ratio | {r['speedup']:.2f}x "
                         f"against {q['speedup']:.2f}x quiet, {keep:.0%} | {ok(keep >= 0.8)} |")
        sparse = {v["threads"]: v["decode_tok_s"] for v in r["variants"].values() if v["kind"] == "2:4"}
        if len(sparse) > 1:
            one, most = sparse[min(sparse)], sparse[max(sparse)]
            lines.append(f"| {d}, busy loop on one core: 2:4 at {max(sparse)} threads no slower than at {min(sparse)} | "
                         f"{most:.2f} against {one:.2f} tok/s | {ok(most >= one)} |")
    best_any = {kind: max(((v["decode_tok_s"], f"{r['dtype']} {n}") for r in result.get("decode", [])
                           for n, v in r["variants"].items() if v["kind"] == kind), default=None)
                for kind in ("dense", "2:4")}
    bf16 = quiet.get("bf16")
    if bf16 and bf16.get("best", {}).get("2:4") and best_any["dense"]:
        v = bf16["variants"][bf16["best"]["2:4"]]["decode_tok_s"]
        lines.append(f"| headline: bf16 2:4 against the best dense of any dtype | {v / best_any['dense'][0]:.2f}x "
                     f"({v:.2f} tok/s against {best_any['dense'][1]}, {best_any['dense'][0]:.2f} tok/s) | reported |")
    runs = result.get("firstcall", {}).get("runs", [])
    # the first call as such, then with the load before it: a 2:4 model loaded from a packed directory
    # is timed by the dispatch in load_pretrained, not after it
    for d in dict.fromkeys(x["dtype"] for x in runs):
        for label, of in (("first call", lambda x: x["first_call_s"]),
                          ("load + first call", lambda x: x["load_s"] + x["first_call_s"])):
            by = {(x["kind"], x["process"]): of(x) for x in runs if x["dtype"] == d}
            if ("dense", "first") in by and ("2:4", "first") in by:
                ratio = by[("2:4", "first")] / by[("dense", "first")]
                lines.append(f"| {d}: {label} of 2:4 <= 1.5x dense's, first process | {by[('2:4', 'first')]:.1f} s "
                             f"against {by[('dense', 'first')]:.1f} s, {ratio:.2f}x | {ok(ratio <= 1.5)} |")
            if ("dense", "second") in by and ("2:4", "second") in by:
                extra = by[("2:4", "second")] - by[("dense", "second")]
                lines.append(f"| {d}: {label} of 2:4 <= dense's + 10 s, second process | {by[('2:4', 'second')]:.1f} s "
                             f"against {by[('dense', 'second')]:.1f} s, {extra:+.1f} s | {ok(extra <= 10)} |")
    lines += _prune_targets(result)
    return lines if len(lines) > 2 else []


#: the sequential prune's peak RSS limit by shape where the issue gives one in GB (1B: its bf16 bytes + 3 GB)
PRUNE_PEAK_GB = {"3b": 14, "8b": 22}
#: the 8B-shaped 2:4 model: loaded packed and decoding, at most this many GB resident
PEAK_8B_GB = 11


def _prune_targets(result: dict) -> list[str]:
    """The prune's targets: sequential at most 1.3x one pass's time; its peak RSS at most the model's
    bf16 bytes plus 3 GB (1B), 14 GB (3B) or 22 GB (8B, wanda)."""
    runs = {r["mode"]: r for r in result.get("prune", {}).get("runs", []) if "skipped" not in r}
    seq, one = runs.get("sequential"), runs.get("one pass")
    if seq is None:
        return []
    lines = [f"| prune, {r['mode']}: finishes | exit status {r['rc']}: {r.get('error') or 'no error recorded'} | **failed** |"
             for r in runs.values() if r.get("rc")]
    if one is not None:
        ratio = seq["wall_s"] / one["wall_s"]
        lines.append(f"| prune: sequential <= 1.3x the time of one pass | {seq['wall_s']:.0f} s against "
                     f"{one['wall_s']:.0f} s, {ratio:.2f}x | {ok(ratio <= 1.3)} |")
    if result.get("shape") in PRUNE_PEAK_GB:
        limit_mb, what = PRUNE_PEAK_GB[result["shape"]] * 1e9 / 2**20, f"{PRUNE_PEAK_GB[result['shape']]} GB"
    else:
        limit_mb, what = (2 * result["model"]["parameters"] + 3e9) / 2**20, "the model's bf16 bytes + 3 GB"
    lines.append(f"| prune, sequential: peak RSS <= {what} ({limit_mb:.0f} MB) | "
                 f"{seq['peak_rss_mb']:.0f} MB | {ok(seq['peak_rss_mb'] <= limit_mb)} |")
    return lines


def render(result: dict) -> str:
    m = result["machine"]
    params = result["model"]["parameters"]
    size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
    lines = [f"Model: `{result['shape']}` ({size} parameters, "
             f"{result['model']['layers']} layers, {'tied' if result['model']['tied'] else 'untied'} output head), "
             f"random bf16 weights written by `benchmarks/models/make_models.py`. Machine: {m['cpu']}, {m['threads']} threads, "
             f"ISA {', '.join(m['isa'])}, torch {m['torch']}, nmcompile {m['nmcompile']}.", ""]
    for r in result.get("decode", []) + result.get("decode busy", []):
        busy = f" With a busy loop {r['busy loop']}." if r.get("busy loop") else ""
        lines += [f"Decode, {r['dtype']}:{busy} greedy `generate` of {r['new_tokens']} tokens after a {r['prompt']}-token "
                  f"prompt, batch 1; dense and 2:4 timed {r['timing']}. Tokens/s of the decode steps (prefill, "
                  f"the prompt and first token, apart; end to end = new tokens / whole call):", "",
                  "| variant | decode tok/s | ms per token | end-to-end tok/s | prefill s | first call s | timed |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, v in r["variants"].items():
            best = " (best)" if name in r["best"].values() else ""
            lines.append(f"| {name}{best} | {_f(v['decode_tok_s'])} | {_f(v['decode_ms'], '.1f')} | "
                         f"{_f(v['end_to_end_tok_s'])} | {_f(v['prefill_s'], '.1f')} | {_f(v['first_call_s'], '.1f')} | "
                         f"{v['timed']} |")
        bd, bs = r["bytes_dense"], r.get("bytes_24")
        lines += ["", f"Weight bytes a token reads: dense {bd['per_token'] / 1e6:.1f} MB"
                  + (f", 2:4 {bs['per_token'] / 1e6:.1f} MB: bound {r['bound']:.3f}x (expected from the shapes "
                     f"{r['bound_expected']:.3f}x)" if bs else "")
                  + (f"; best 2:4 / best dense {r['speedup']:.2f}x decode, {_f(r.get('speedup_end_to_end'))}x end to end"
                     if r.get("speedup") else "") + ". "
                  + (f"Streamed: 2:4 {r['gbps_24']:.1f} GB/s" if r.get("gbps_24") else "")
                  + (f", dense {r['gbps_dense']:.1f} GB/s" if r.get("gbps_dense") else "")
                  + f"; read bandwidth probes {', '.join(f'{b:.1f}' for b in r['bandwidth_gbps'])} GB/s.",
                  "", f"Resident parameters: dense {bd['resident'] / 1e9:.3f} GB"
                  + (f", 2:4 {bs['resident'] / 1e9:.3f} GB ({r['resident_ratio']:.3f}x; expected "
                     f"{r['resident_ratio_expected']:.3f}x)" if bs else "")
                  + ". Process RSS (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in r["rss_mb"].items()) + "."]
        if "build" in r:
            b = r["build"]
            lines += ["", f"2:4 model made in {b['load_s']:.1f} s load + {b['prune_s']:.1f} s magnitude prune and "
                      f"finalize + {b['pack_s']:.1f} s pack (the dispatch timing); {b['packed']} layers packed, kernel "
                      f"ranges {', '.join(b['ranges'])}; left dense: {', '.join(b['left_dense']) or 'none'}."]
        same = {k: r[k] for k in ("same tokens dense", "same tokens 2:4") if k in r}
        if same:
            lines += ["", "Same greedy tokens as the first variant of its kind: " + "; ".join(
                f"{k[12:]}: {', '.join(n for n, s in v.items() if s)} (differ: {', '.join(n for n, s in v.items() if not s) or 'none'})"
                for k, v in same.items()) + "."]
        if r["skipped"]:
            lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in r["skipped"].items()) + "."]
        lines.append("")
    runs = result.get("firstcall", {}).get("runs", [])
    if runs:
        lines += ["First call in fresh processes (ready: 2:4's packing and dispatch timing after the load; then the "
                  "first `generate`, compiles included); the second process finds the first one's caches:", "",
                  "| dtype | kind | process | load s | ready s | first generate s | first call s | second generate s | "
                  "RSS after MB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for x in runs:
            lines.append(f"| {x['dtype']} | {x['kind']} | {x['process']} | {x['load_s']:.1f} | {x['prepare_s']:.1f} | "
                         f"{x['first_generate_s']:.1f} | {x['first_call_s']:.1f} | {x['second_generate_s']:.1f} | "
                         f"{x['rss_mb']['after']:.0f} |")
        lines.append("")
    p = result.get("prune")
    if p:
        lines += [f"`nmcompile prune --recipe {p['recipe']}` on {p['samples']} x {p['seq_len']} random token ids "
                  "(the model in its stored dtype; the wall time includes loading, the held-out loss before and after, and "
                  "writing the pruned directory):", "",
                  "| calibration | wall s | peak RSS MB | where the peak was reached |", "| --- | --- | --- | --- |"]
        for x in p["runs"]:
            if "skipped" in x:
                lines.append(f"| {x['mode']} | skipped: {x['skipped']} | | |")
            else:
                where = f"{x['peak_at_s']:.0f} s: `{x['peak_where']}`" if x.get("peak_where") else "not recorded"
                failed = f" (failed, exit status {x['rc']})" if x.get("rc") else ""
                lines.append(f"| {x['mode']}{failed} | {x['wall_s']:.1f} | {x['peak_rss_mb']:.0f} | {where} |")
        lines.append("")
    verdicts = targets(result)
    if verdicts:
        lines += ["Against the targets (computed from this file by `--render`):", "", *verdicts]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(make_models.SHAPES))
    parser.add_argument("--model", help="the model directory (default /work/models/llama-SHAPE)")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", help="results JSON (parts run now replace theirs in an existing file)")
    parser.add_argument("--render", metavar="JSON", help="print the markdown tables of a result file and exit")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--threads", nargs="+", type=int, default=None, help="default: 1 and all")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds after the first calls (default 3)")
    parser.add_argument("--slow", type=float, default=3.0)
    parser.add_argument("--sparse-modes", nargs="+", choices=("eager", "compiled"), default=["compiled"])
    parser.add_argument("--dense-modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    parser.add_argument("--max-gb", type=float, default=None, help="memory this run may use (default: 90%% of "
                        "what is available at start)")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--calib-len", type=int, default=512)
    parser.add_argument("--prune-recipe", default="sparsegpt:2:4")
    parser.add_argument("--prune-modes", nargs="+", choices=("one pass", "sequential"), default=["one pass", "sequential"])
    parser.add_argument("--busy", action="store_true", help="decode with a busy loop pinned to the last core (another "
                        "user's job), for the shared-core figures")
    parser.add_argument("--" + FIRSTCALL_CHILD, nargs=2, metavar=("KIND", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return 0
    child = getattr(args, FIRSTCALL_CHILD.replace("-", "_"))
    if child:
        print(json.dumps(firstcall_child(args.model, *child, args.new_tokens, args.prompt)))
        return 0
    if not args.shape:
        parser.error("--shape is required (or --render)")
    from nmcompile.kernels import cpu24

    state = cpu24.status()
    if not state.available:
        print(f"the 2:4 CPU kernel is not available here: {state.reason}")
        return 0
    max_gb = args.max_gb if args.max_gb is not None else 0.9 * available_gb()
    threads = args.threads or sorted({1, torch.get_num_threads()})
    tmp_model = None
    path = args.model or default_dir(args.shape)
    if not os.path.isdir(path):
        if args.shape != "tiny" or args.model:
            print(f"{path}: no such model directory; write it with python benchmarks/models/make_models.py --shape "
                  f"{args.shape} --out {path}", file=sys.stderr)
            return 2
        tmp_model = tempfile.mkdtemp(prefix="real_scale_tiny_")
        path = os.path.join(tmp_model, "llama-tiny")
        make_models.write_model(path, "tiny", log=lambda line: None)
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    params = sum(p.numel() for p in meta_model(path, torch.bfloat16).parameters())
    result = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
        if result.get("shape") != args.shape:
            print(f"{args.out} holds shape {result.get('shape')}, not {args.shape}; give another --out", file=sys.stderr)
            return 2
    result.update(shape=args.shape, machine=machine(),
                  model={"dir": path, "parameters": params, "layers": config.num_hidden_layers,
                         "tied": bool(config.tie_word_embeddings), "hidden": config.hidden_size,
                         "intermediate": config.intermediate_size, "vocab": config.vocab_size},
                  max_gb=max_gb, kernel_build_or_load_s=state.build_seconds)
    print(f"{result['machine']}\n{args.shape}: {path}, {params / 1e6:.1f} M parameters; memory budget {max_gb:.1f} GB",
          flush=True)

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    try:
        if "decode" in args.only:
            busy = busy_loop(os.cpu_count() - 1) if args.busy else None
            try:
                rows = decode(path, args.dtypes, threads, args.new_tokens, args.prompt, args.runs, args.slow,
                              max_gb, sparse_modes=tuple(args.sparse_modes), dense_modes=tuple(args.dense_modes))
            finally:
                if busy is not None:
                    busy.kill()
            for row in rows:
                row["busy loop"] = f"pinned to core {os.cpu_count() - 1}" if busy is not None else None
            result["decode busy" if busy is not None else "decode"] = rows
            save()
        if "firstcall" in args.only:
            result["firstcall"] = firstcall(path, args.dtypes, args.new_tokens, args.prompt)
            save()
        if "prune" in args.only:
            result["prune"] = prune(path, args.calib_samples, args.calib_len, max_gb, args.prune_recipe,
                                    args.prune_modes)
            save()
    finally:
        if tmp_model:
            shutil.rmtree(tmp_model, ignore_errors=True)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
