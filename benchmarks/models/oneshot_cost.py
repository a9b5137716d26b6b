"""Cost and quality of one-shot pruning: sequential vs one-pass calibration, Wanda vs SparseGPT.

    nice -n 10 python benchmarks/models/oneshot_cost.py char       # a character GPT trained here on Shakespeare
    nice -n 10 python benchmarks/models/oneshot_cost.py gpt2m      # GPT-2-medium shapes from a config (random weights)

Each configuration runs in its own subprocess, so that its peak resident memory (``VmHWM``,
``benchmarks.toolbox.peak_mb``) is its own: load or train the dense model, declare the recipe, compile with ``backend="nmsparse"`` (``inner``: Inductor for the sequential form, which
updates the statistics in place, ``aot_eager`` for one pass, as ``nmcompile prune`` chooses),
run the calibration batches (``nmcompile.finalize(model, calibration=fn, sequential=...)``) and solve. Printed
per configuration: calibration + solve seconds (compiled before the timing), the statistics buffers' size, peak RSS,
the resident memory before finalize and the most finalize added to it (sampled every 20 ms), and for the
trained character GPT the held-out loss (dense, magnitude 2:4, and each one-shot configuration). The random
GPT-2-medium-shaped model measures time and memory only (its loss means nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # this tree's nmcompile first, and benchmarks.toolbox

from benchmarks.toolbox import peak_mb, resident_mb  # noqa: E402


class _Sampler:
    """The highest resident memory seen every 20 ms while the block runs."""

    def __enter__(self):
        import threading

        self.peak, self._stop = resident_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, resident_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_mb())


def _char_model(args):
    from nmcompile.app.chargpt import CharGPT, GPTConfig
    from nmcompile.app.datasets import CharCorpus, shakespeare

    corpus = CharCorpus(shakespeare())
    path = os.path.join(args.cache, f"char_w{args.width}_l{args.layers}_s{args.steps}_b{args.train_batch}_c{args.context}.pt")
    torch.manual_seed(0)
    model = CharGPT(GPTConfig(vocab=corpus.vocab, context=args.context, width=args.width, layers=args.layers, heads=4))
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, weights_only=True))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
        step = torch.compile(lambda x, y: F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        for i in range(args.steps):
            x, y = corpus.batch("train", args.train_batch, args.context, g)
            if i % 100 == 0:
                print(f"training the character GPT: step {i}/{args.steps}", file=sys.stderr, flush=True)
            loss = step(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        os.makedirs(args.cache, exist_ok=True)
        torch.save(model.state_dict(), path)
    g = torch.Generator().manual_seed(1)
    calib = [corpus.batch("train", args.batch, args.context, g)[0] for _ in range(args.batches)]
    g = torch.Generator().manual_seed(2)
    held = [corpus.batch("val", 64, args.context, g) for _ in range(8)]

    def loss_of(m):
        with torch.no_grad():
            return sum(float(F.cross_entropy(m(x).flatten(0, 1), y.flatten())) for x, y in held) / len(held)

    return model.eval(), calib, loss_of, ["head*"]


def _gpt2m_model(args):
    import transformers

    config = transformers.GPT2Config(n_embd=1024, n_layer=args.layers, n_head=16, n_positions=1024, vocab_size=50257,
                                     use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 50257, (args.batch, args.context), generator=g) for _ in range(args.batches)]
    return model, calib, None, ["*lm_head*"]


def one(args) -> dict:
    """One configuration, in this process."""
    import nmcompile

    torch.set_num_threads(args.threads)
    model, calib, loss_of, exclude = (_char_model if args.model == "char" else _gpt2m_model)(args)
    base = peak_mb()
    out = {"config": args.config, "rss_model_mb": base}
    if args.config == "dense":
        out["loss"] = loss_of(model) if loss_of else None
        return out
    if args.config == "magnitude":
        report = nmcompile.annotate(model, "asp:2:4,permute=0", exclude=exclude)
        nmcompile.finalize(model)
        out["loss"] = loss_of(model) if loss_of else None
        out["weights"] = len(report.annotated)
        return out
    recipe, mode = args.config.split("/")
    report = nmcompile.annotate(model, recipe, exclude=exclude)
    sequential = mode == "sequential"
    inner = args.inner or ("inductor" if sequential else "aot_eager")  # as `nmcompile prune` chooses
    out["inner"] = inner
    compiled = torch.compile(model, backend="nmsparse", options={"inner": inner})
    passes = []

    def calibration():
        t = time.perf_counter()
        with torch.no_grad():
            for x in calib:
                compiled(x)
        passes.append(time.perf_counter() - t)

    import warnings

    from nmcompile.oneshot.solve import calibrated, reset
    from nmcompile.state.records import state_of

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            for _, places, ann in calibrated(model):  # paused: the compile run gathers (and touches) nothing
                state_of(places[0][1], places[0][2], ann)[1].fill_(-1)
            compiled(calib[0])  # compile outside the timing
        reset(model)
        out["stats_mb"] = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "_nm_" in n) / 2**20
        out["rss_before_mb"] = peak_mb()
        out["resident_before_mb"] = resident_mb()
        start = time.perf_counter()
        with _Sampler() as sampled:
            nmcompile.finalize(model, calibration=calibration, sequential=sequential)
    out["resident_peak_in_finalize_mb"] = sampled.peak
    out["seconds"] = time.perf_counter() - start
    out["calibration_seconds"] = sum(passes)
    out["passes"] = len(passes)
    out["rss_peak_mb"] = peak_mb()
    out["loss"] = loss_of(model) if loss_of else None
    out["weights"] = len(report.annotated)
    out["tokens"] = sum(x.numel() for x in calib)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["char", "gpt2m"])
    parser.add_argument("--config", default=None, help="(internal) run one configuration and print its JSON")
    parser.add_argument("--configs", default="dense,magnitude,wanda:2:4/one-pass,wanda:2:4/sequential,"
                        "sparsegpt:2:4/one-pass,sparsegpt:2:4/sequential")
    parser.add_argument("--layers", type=int, default=None, help="blocks (char default 4, gpt2m default 24)")
    parser.add_argument("--width", type=int, default=128, help="char GPT width (default 128)")
    parser.add_argument("--steps", type=int, default=400, help="char GPT training steps (cached)")
    parser.add_argument("--train-batch", type=int, default=16, help="char GPT training batch (default 16)")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence (char 64, gpt2m 128)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default=os.path.join("/tmp", "nmcompile-oneshot-cache"))
    parser.add_argument("--inner", default=None, help="inner compiler of the calibration graph (default: inductor "
                        "for sequential, which updates the statistics in place, aot_eager for one pass)")
    args = parser.parse_args()
    args.layers = args.layers or (4 if args.model == "char" else 24)
    args.context = args.context or (64 if args.model == "char" else 128)
    if args.config:
        print(json.dumps(one(args)))
        return
    rows = []
    for config in args.configs.split(","):
        cmd = [sys.executable, __file__, args.model, "--config", config, "--layers", str(args.layers), "--width",
               str(args.width), "--steps", str(args.steps), "--train-batch", str(args.train_batch), "--context", str(args.context), "--batch", str(args.batch),
               "--batches", str(args.batches), "--threads", str(args.threads), "--cache", args.cache,
               *(["--inner", args.inner] if args.inner else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        if done.returncode:
            print(f"{config}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.model}: layers {args.layers}, {args.batches} x {args.batch} x {args.context} calibration tokens")
    print("| configuration | inner | held-out loss | calibration + solve (s) | calibration passes (s) | statistics (MB) "
          "| peak RSS (MB) | resident before finalize (MB) | most resident during finalize, added (MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "-"
        if "seconds" in r:
            print(f"| {r['config']} | {r['inner']} | {loss} | {r['seconds']:.1f} | {r['passes']} "
                  f"({r['calibration_seconds']:.1f}) | {r['stats_mb']:.0f} | {r['rss_peak_mb']:.0f} | "
                  f"{r['resident_before_mb']:.0f} | {r['resident_peak_in_finalize_mb'] - r['resident_before_mb']:.0f} |")
        else:
            print(f"| {r['config']} | - | {loss} | - | - | - | - | - | - |")


if __name__ == "__main__":
    main()
