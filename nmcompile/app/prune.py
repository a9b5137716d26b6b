"""``nmcompile prune``: one-shot N:M pruning of a trained causal language model from calibration text.

    nmcompile prune MODEL --recipe sparsegpt:2:4 --calibration FILE --out DIR

``MODEL`` is a local Hugging Face model directory (``config.json``, weights, tokenizer) or a
``torch.save``'d ``nn.Module`` (a ``.pt`` file of a whole model, loaded with ``weights_only=False``:
only for files you trust). Nothing is downloaded. The calibration text is tokenised with the model's
tokenizer (a ``.pt`` model: ``--tokenizer DIR``, its ``chars`` attribute for a character model, or a
``.pt`` file of token ids instead of text) and cut into ``--samples`` windows of ``--seq-len`` tokens;
held-out text (``--held-out``, else the last tenth of the calibration text, never calibrated on) gives
the evaluation loss before and after. The model is declared with the recipe (:func:`nmcompile.annotate`),
compiled with the ``nmsparse`` backend, run over the windows with a progress bar, solved by
:func:`nmcompile.finalize`, checked N:M, and saved by :func:`nmcompile.deploy.save_pretrained`: a Hugging Face
directory (safetensors, loadable without nmcompile) or ``model.pt``, plus ``nmcompile.json`` (which weight is N:M
along which dim: :func:`nmcompile.deploy.load_pretrained` loads the directory as deployed) and, for 2:4,
``model_packed.pt`` with every 2:4 weight packed.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .progress import Progress

__all__ = ["prune_model", "PruneSummary", "format_summary"]


@dataclass
class PruneSummary:
    recipe: str
    pruned: list[str]
    loss_before: float
    loss_after: float
    calibration_tokens: int
    held_out_tokens: int
    seconds: float
    files: list[str]
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _load(path: str, tokenizer_dir: str | None):
    """``(model, encode, kind)``; ``encode(text) -> 1-D int64 ids`` (None: only id files)."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"{path} is a folder without config.json: not a Hugging Face model directory")
        try:
            import transformers
        except ImportError as err:
            raise ImportError("nmcompile prune on a Hugging Face directory needs transformers (pip install "
                              "transformers)") from err
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir or path, local_files_only=True)
        return model, lambda text: torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long), ("hf", tokenizer)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such model directory or file")
    model = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{path} holds a {type(model).__name__}, not a torch.save'd nn.Module; save the whole model "
                         "(torch.save(model, path)) or give a Hugging Face directory")
    if tokenizer_dir is not None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        return model, lambda text: torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long), ("pt", None)
    chars = getattr(model, "chars", None)
    if chars is not None:
        lookup = {c: i for i, c in enumerate(chars)}
        return model, lambda text: torch.tensor([lookup[c] for c in text if c in lookup], dtype=torch.long), ("pt", None)
    return model, None, ("pt", None)


def _ids(path: str, encode) -> torch.Tensor:
    if path.endswith((".pt", ".pth")):
        ids = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            raise ValueError(f"{path}: a .pt calibration file holds a tensor of token ids")
        return ids.reshape(-1).long()
    if encode is None:
        raise ValueError(f"{path}: this model has no tokenizer; give --tokenizer DIR (a Hugging Face tokenizer) or a "
                         ".pt file of token ids")
    with open(path, encoding="utf-8") as handle:
        return encode(handle.read())


def _windows(ids: torch.Tensor, seq_len: int, samples: int | None) -> list[torch.Tensor]:
    count = len(ids) // seq_len
    if samples is not None:
        count = min(count, samples)
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(count)]


def _logits(model, batch):
    out = model(batch)
    return out if isinstance(out, torch.Tensor) else out.logits


def _loss(model, windows, batch_size: int) -> float:
    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            batch = torch.stack(windows[i:i + batch_size])
            logits = _logits(model, batch)[:, :-1].float()
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"))
            tokens += batch[:, 1:].numel()
    return total / max(tokens, 1)


def prune_model(model_path: str, recipe: str, calibration: str, out: str, *, held_out: str | None = None,
                seq_len: int = 128, samples: int | None = 128, batch_size: int = 8, sequential: bool = False,
                include=None, exclude=None, tokenizer: str | None = None, inner: str | None = None,
                progress: bool = True) -> PruneSummary:
    """Prune ``model_path`` in one shot with ``recipe`` (``wanda`` or ``sparsegpt``); see the module doc."""
    from ..declare.annotate import annotate
    from ..deploy.finalize import finalize
    from ..deploy.inspection import check as check_nm
    from ..deploy.saving import save_pretrained
    from ..recipes import parse

    start = time.perf_counter()
    parsed = parse(recipe)
    if not parsed.calibrated:
        raise ValueError(f"nmcompile prune takes a one-shot recipe (wanda, sparsegpt), not {parsed}; recipes that "
                         "train go through your training loop (see docs/recipes.md)")
    model, encode, (kind, hf_tokenizer) = _load(model_path, tokenizer)
    ids = _ids(calibration, encode)
    if held_out is None:
        split = int(0.9 * len(ids))
        ids, held = ids[:split], ids[split:]
    else:
        held = _ids(held_out, encode)
    calib, evals = _windows(ids, seq_len, samples), _windows(held, seq_len, None)
    if not calib:
        raise ValueError(f"{calibration}: {len(ids)} calibration tokens make no window of --seq-len {seq_len}; give "
                         "more text or a shorter --seq-len")
    if not evals:
        raise ValueError(f"held-out text: {len(held)} tokens make no window of --seq-len {seq_len}")
    model.eval()
    loss_before = _loss(model, evals, batch_size)
    report = annotate(model, parsed, include=include, exclude=list(exclude) if exclude else None)
    if not report.annotated:
        raise ValueError(f"no weight of {model_path} takes {parsed}: {report}")
    if inner is None:  # aot_eager copies every statistics buffer back at each call: all would be resident
        inner = "inductor" if sequential else "aot_eager"
    compiled = torch.compile(model, backend="nmsparse", options={"inner": inner})
    batches = [torch.stack(calib[i:i + batch_size]) for i in range(0, len(calib), batch_size)]
    passes = [0]

    def run_calibration():
        passes[0] += 1
        bar = Progress(len(batches), f"calibrating (pass {passes[0]})", enabled=progress)
        with torch.no_grad():
            for i, batch in enumerate(batches):
                compiled(batch)
                bar.update(i + 1)
        bar.close()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*recipe state for")
        finalized = finalize(model, calibration=run_calibration, sequential=sequential)
    check = check_nm(model)
    if not check.ok:
        raise RuntimeError(f"nmcompile prune: the pruned model is not {parsed.pattern}:\n{check}")
    loss_after = _loss(model, evals, batch_size)
    files = save_pretrained(model, out, tokenizer=hf_tokenizer, hf=kind == "hf")
    return PruneSummary(str(parsed), sorted(finalized), loss_before, loss_after, sum(len(w) for w in calib),
                        sum(len(w) for w in evals), time.perf_counter() - start, files, dict(finalized.fallbacks),
                        dict(report.skipped))


def format_summary(s: PruneSummary) -> str:
    lines = [
        f"nmcompile prune: {len(s.pruned)} weights pruned {s.recipe} from {s.calibration_tokens} calibration tokens "
        f"in {s.seconds:.1f}s",
        f"  held-out loss ({s.held_out_tokens} tokens): dense {s.loss_before:.4f} (ppl {math.exp(min(s.loss_before, 50)):.2f})"
        f" -> pruned {s.loss_after:.4f} (ppl {math.exp(min(s.loss_after, 50)):.2f})",
    ]
    lines += [f"  ! {note}" for notes in s.fallbacks.values() for note in notes]
    lines += [f"  - {name}: left dense, {why}" for name, why in s.skipped.items()]
    lines += [f"  wrote {path}" for path in s.files]
    return "\n".join(lines)
