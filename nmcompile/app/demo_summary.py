"""The words of ``nmcompile demo``'s summary: what ran, what stopped it early, what the deployed model runs.

Pure functions of the summary dict :func:`nmcompile.app.demo.run_demo` returns, so that each case
(every step run, stopped by the time cap, no dense reference, no layer on the 2:4 kernel) is said
the same way in the printed summary and checked by tests without a run.
"""

from __future__ import annotations

__all__ = ["format_summary", "training_line", "reference_line", "deploy_line", "uses_kernel"]


def _minutes(value: float) -> str:
    return f"{value:g}-minute"


def training_line(s: dict) -> str:
    """The recipe's run: steps, time, validation loss, and why it stopped early when it did."""
    ran, planned = s["steps"], s.get("steps_planned", s["steps"])
    if s.get("stopped") == "time":
        first = s.get("first_step_seconds")
        why = (f"stopped at {ran} of {planned} steps: the {_minutes(s['minutes'])} cap (counted from the start"
               + (f"; compiling and the first evaluation took {first:.0f} s" if first is not None else "") + ")")
    else:
        why = f"{ran} steps"
    line = f"recipe {s['recipe']}: {why} in {s['seconds']} s, validation loss {s['validation_loss']:.3f} nats/char"
    dense = s.get("dense_validation_loss")
    if dense is not None and s.get("dense_steps") == ran:
        line += (f" (dense on the same batches: {dense:.3f}; the recipe costs "
                 f"{s['validation_loss'] - dense:+.3f})")
    if s.get("stopped") == "time" and ran < max(planned // 4, 1):
        line += ("; so few steps leave the model undertrained and the sample below noisy: give it more time "
                 "(--minutes) on a quieter machine")
    return line


def reference_line(s: dict) -> str | None:
    """The dense reference, where it did not simply run the recipe's steps (None when it did, or was not asked for)."""
    skipped = s.get("dense_skipped")
    if skipped:
        return f"dense reference: skipped: {skipped}"
    dense_steps = s.get("dense_steps")
    if dense_steps is None or dense_steps == s["steps"]:
        return None
    dense = s.get("dense_validation_loss")
    loss = "" if dense is None else f", validation loss {dense:.3f} (not comparable: fewer steps than the recipe's run)"
    return f"dense reference: stopped at {dense_steps} of {s['steps']} steps: the {_minutes(s['minutes'])} cap{loss}"


def uses_kernel(decision) -> bool:
    """Whether a deploy decision runs a 2:4 kernel for some token count (a ``Decision``, not a string)."""
    return not isinstance(decision, str) and decision.sparse and decision.max_tokens != 0


def deploy_line(d: dict) -> str:
    """The deployed model: which layers run the 2:4 kernel and, only when some do, how fast it generates."""
    diff = d.get("max_abs_diff")
    close = "" if diff is None else f"logits within {diff:.2g} of the eager model's, "
    same = "the same greedy text" if d["same_text"] else "another greedy text (logits that nearly tie round apart)"
    head = f"deployed 2:4 (backend='nmsparse', {d['chars']} chars: {close}{same})"
    if not d["kernel_layers"]:
        why = d.get("why") or "each was measured no faster than dense"
        return (f"{head}: none of the {d['layers']} layers runs the 2:4 kernel at these sizes ({why}); the kernel "
                "pays on weights of 16 MB and more when decoding (docs/benchmarks.md), so no speed is compared here")
    names = ", ".join(d["kernel_layers"])
    line = f"{head}: {len(d['kernel_layers'])} of {d['layers']} layers run the 2:4 kernel ({names})"
    if "sparse_chars_per_s" in d:
        line += (f"; generation on one thread, dense and 2:4 interleaved: dense {d['dense_chars_per_s']:.0f} chars/s, "
                 f"2:4 {d['sparse_chars_per_s']:.0f} chars/s ({d['sparse_chars_per_s'] / d['dense_chars_per_s']:.2f}x)")
    return line


def format_summary(summary: dict) -> str:
    lines = [training_line(summary)]
    reference = reference_line(summary)
    if reference:
        lines.append(reference)
    lines += [
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
    if "deploy" in summary:
        lines.append(deploy_line(summary["deploy"]))
    if "timings" in summary:
        t = summary["timings"]
        lines.append(f"took {t['total']:.0f} s: training {t['training']:.0f} s (capped at {summary['minutes']:g} min), "
                     f"then finalize, plots, export and the deploy check {t['after']:.0f} s")
    return "\n".join(lines)
