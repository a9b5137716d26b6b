"""``nmcompile recover``: get back what one-shot pruning cost, by distillation from the dense model, mask kept.

:func:`recover_model` loads a pruned directory (``nmcompile prune``'s or :func:`nmcompile.deploy.save_pretrained`'s)
and its dense teacher, tokenizes the text with the pruned directory's tokenizer (the last tenth held out unless
``held_out`` is given), declares ``recipe`` (default ``asp:2:4,permute=0``: each N:M weight's mask is its
non-zeros, kept) on exactly the weights the directory records as N:M (a recorded weight the recipe does not take
stops it, by name: none trains dense unseen), compiles the student with ``backend="nmsparse"`` and trains it
``steps`` AdamW steps on random windows of the text with :class:`nmcompile.training.distill.Distillation`
(logits at ``temperature``, the labels' cross entropy with weight ``task``, SquareHead's layer-wise term with
``layers``), on the GPU it finds or the CPU, with a progress bar (loss, ETA). Every ``save_every`` steps it
writes the student, the optimizer and the step beside ``out`` (``<out>.recover-state.pt``), and a run given the
same arguments resumes there. Then it finalizes, checks N:M, prints the held-out loss of the teacher and of the
student before and after, and writes ``out`` as prune does: whole or not at all (a temporary folder renamed at
the end), with ``nmcompile-recover.json``, so ``nmcompile check OUT`` passes and ``load_pretrained(OUT,
packed=True)`` serves it. Weights the directory holds as int8 or 4-bit values train with their grid's
rounding in the forward (``bits=`` added to the recipe: ``asp:2:4,permute=0,bits=4``, straight-through) and are
saved as codes again: a 2:4+int4 model recovers as a 2:4+int4 model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..checkpoint import folders, saving
from ..checkpoint.loading import load_pretrained
from ..checkpoint.quantized_weights import WIDTHS, grids_of
from ..checkpoint.restore import layout_from
from ..declare.annotate import annotate
from ..oneshot.compute_dtype import compute_dtype, stored_dtype
from ..recipes import parse
from ..state import memory
from ..deploy.finalize import finalize
from ..deploy.inspection import check as check_nm
from ..training.distill import Distillation
from .progress import Progress
from .prune import _check_ids, _ids, _loss, _output_folder, _windows

__all__ = ["recover_model", "RecoverSummary", "format_summary", "RECORD"]

#: the folder's record of a recovery
RECORD = "nmcompile-recover.json"
#: the recipe trained where none is given: each N:M weight's mask is its non-zeros, kept
DEFAULT_RECIPE = "asp:2:4,permute=0"


@dataclass
class RecoverSummary:
    recipe: str
    steps: int
    loss_teacher: float
    loss_before: float
    loss_after: float
    train_tokens: int
    held_out_tokens: int
    seconds: float
    seconds_per_step: float
    device: str
    resumed_at: int = 0
    dtype: str = ""
    weights: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    out: str = ""


def _state_path(out: str) -> str:
    return os.path.abspath(out).rstrip(os.sep) + ".recover-state.pt"


def _recipes(pruned: str, layout, grids: dict, recipe: str | None) -> dict[str, list[str]]:
    """``{recipe: weight names}``: ``recipe`` (default ``asp:2:4,permute=0``) on every N:M weight the directory
    records, with ``bits``/``group`` added where it holds them as int8 or 4-bit values (so they train on their
    grids and are saved as codes again). A recipe that names ``bits`` other than a weight's, or a quantized
    weight under a recipe without ``bits``, is refused by name."""
    out: dict[str, list[str]] = {}
    for name in sorted(layout.weights):
        spec = recipe or DEFAULT_RECIPE
        if layout.weights[name].bits and name not in grids:  # recorded as codes, but no grid came with the load
            raise ValueError(f"{pruned}: {name} is recorded with {layout.weights[name].bits}-bit values but its grid "
                             "was not loaded, so it would train and save as float values; run nmcompile check on the "
                             "directory (its codes file may be missing)")
        if name in grids:
            bits, scales = grids[name]
            entry = layout.weights[name]
            group = entry.shape[entry.dim] // scales.shape[-1] if bits == 4 else None
            given = parse(spec)
            if getattr(given, "bits", None) is None and recipe is not None:
                raise ValueError(f"{pruned}: {name} holds {WIDTHS[bits]} values; --recipe {recipe} would train and "
                                 f"save them as float values: give --recipe asp:2:4,permute=0,bits={bits}"
                                 f"{f',group={group}' if group else ''} (or leave --recipe out)")
            if getattr(given, "bits", None) is None:
                spec = f"{spec},bits={bits}" + (f",group={group}" if group and group != 64 else "")
            elif (given.bits, given.group if bits == 4 else None) != (bits, group):
                raise ValueError(f"{pruned}: {name} holds {WIDTHS[bits]} values{f' in groups of {group}' if group else ''}"
                                 f"; --recipe {recipe} rounds to bits={given.bits}"
                                 f"{f',group={given.group}' if given.bits == 4 else ''}: match the directory")
        out.setdefault(spec, []).append(name)
    return out


def _training_dtype(student, asked: torch.dtype | None) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: ``asked``; else float32 for a bf16/fp16 student on a CPU without native arithmetic for it
    (PyTorch's bf16 GEMMs of a training step's backward run there far slower than float32: a layer's input gradient
    ``[128, 8192] x [8192, 2048]`` took 17.2 s in bf16 against 0.11 s on the same operands cast to float32, on a
    2-core AVX2 EPYC; ``benchmarks/training/bf16_gemms.py``) where
    float32 weights, gradients, AdamW's two moments and a float32 teacher fit in the memory available; else the
    stored dtype, said to be slow."""
    stored = stored_dtype(student)
    if asked is not None:
        return asked, "as asked (--dtype)"
    if torch.cuda.is_available():
        return stored, "the stored dtype (GPU)"
    dtype, why = compute_dtype(student)
    if dtype == stored:
        return stored, "the stored dtype"
    need = 5 * 4 * sum(p.numel() for p in student.parameters())  # weights, gradients, 2 moments, the teacher
    if need > 0.9 * memory.available_bytes():
        return stored, (f"{why.split(': ', 1)[-1]}, so each step is far slower than in float32, whose weights, "
                        f"gradients, AdamW state and teacher ({need / 2**30:.1f} GiB) do not fit in the memory "
                        f"available ({memory.available_bytes() / 2**30:.1f} GiB); --dtype float32 forces it")
    return torch.float32, (f"{why.split(': ', 1)[-1]}; saved in {str(stored).replace('torch.', '')} "
                           "(--dtype to choose)")


def recover_model(pruned: str, teacher: str, data: str, out: str, *, steps: int = 200, lr: float = 1e-4,
                  seq_len: int = 128, batch_size: int = 8, recipe: str | None = None, temperature: float = 1.0,
                  task: float = 1.0, layers: float = 0.0, held_out: str | None = None, save_every: int = 50,
                  seed: int = 0, inner: str | None = None, overwrite: bool = False,
                  progress: bool = True, dtype: torch.dtype | None = None) -> RecoverSummary:
    """Recover ``pruned`` by distillation from ``teacher`` on the text ``data``; see the module doc. ``inner``: the
    backend's inner compiler (default Inductor); ``dtype``: the dtype both models train in (default: see
    :func:`_training_dtype`), the output saved in the directory's own."""
    start = time.perf_counter()
    for flag, value in (("--steps", steps), ("--seq-len", seq_len - 1), ("--batch", batch_size),
                        ("--save-every", save_every)):
        if value < 1:
            raise ValueError(f"{flag} {value if flag != '--seq-len' else seq_len}: must be at least "
                             f"{2 if flag == '--seq-len' else 1}")
    layout, _ = layout_from(pruned)
    out, keep = _output_folder(out, [pruned, teacher], overwrite, RECORD, "nmcompile recover")
    say = (lambda text: print(f"nmcompile recover: {text}", file=sys.stderr, flush=True)) if progress else (lambda _: 0)
    say(f"loading {pruned} and the teacher {teacher}")
    student = load_pretrained(pruned)
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(pruned, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{pruned}: no tokenizer could be loaded ({str(err).splitlines()[0]}); nmcompile prune "
                         "saves the model's tokenizer beside it: copy it there") from err
    encode = lambda text: torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)  # noqa: E731
    stored = stored_dtype(student)
    dtype, why = _training_dtype(student, dtype)
    say(f"training in {str(dtype).replace('torch.', '')}: {why}")
    student.to(dtype)
    dense = transformers.AutoModelForCausalLM.from_pretrained(teacher, local_files_only=True, dtype=dtype)
    ids = _ids(data, encode)
    if held_out is None:
        ids, held = ids[:int(0.9 * len(ids))], ids[int(0.9 * len(ids)):]
    else:
        held = _ids(held_out, encode)
    for model, where in ((student, data), (dense, data)):
        _check_ids(model, ids, seq_len, where)
    train, evals = _windows(ids, seq_len, None), _windows(held, seq_len, None)
    if not train or not evals:
        raise ValueError(f"{data}: {len(ids)} training and {len(held)} held-out tokens make "
                         f"{len(train)} and {len(evals)} windows of --seq-len {seq_len}; give more text or a shorter "
                         "--seq-len")
    saving.check_disk(student, out, what="nmcompile recover")
    bar = lambda total, label: Progress(total, label, enabled=progress)  # noqa: E731
    loss_teacher = _loss(dense, evals, batch_size, "hf", bar(len(evals), "held-out loss, teacher"))
    loss_before = _loss(student, evals, batch_size, "hf", bar(len(evals), "held-out loss, pruned"))
    recipes = _recipes(pruned, layout, grids_of(student, layout), recipe)
    for spec, names in recipes.items():
        report = annotate(student, spec, include=names)
        untaken = sorted(set(names) - set(report.annotated))
        if untaken:
            raise ValueError(f"--recipe {spec} does not take {', '.join(untaken[:3])} (recorded N:M in {pruned}): it "
                             f"would train dense; {report}")
    recipe = " + ".join(recipes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    student.to(device)
    dense.to(device)
    compiled = torch.compile(student, backend="nmsparse", dynamic=False, options={"inner": inner} if inner else None)
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    state_path, resumed, rng = _state_path(out), 0, None
    args = {"pruned": os.path.abspath(pruned), "teacher": os.path.abspath(teacher), "steps": steps, "lr": lr,
            "seq_len": seq_len, "batch": batch_size, "recipe": recipe, "seed": seed, "dtype": str(dtype)}
    if os.path.isfile(state_path):
        saved = torch.load(state_path, map_location=device, weights_only=False)
        if saved.get("args") == args:
            student.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            resumed, rng = saved["step"], saved["rng"]
            say(f"resuming at step {resumed} of {steps} from {state_path}")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(train), (steps, batch_size), generator=gen)
    lm_loss = lambda logits, batch: F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),  # noqa: E731
                                                    batch[:, 1:].reshape(-1))
    train_bar, times = Progress(steps, "recovering, steps", enabled=progress), []
    with Distillation(student, dense, temperature=temperature, task=task, layers=layers) as distill, \
            torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(seed)  # dropout's draws: a resumed run draws what the whole one would have
        if rng is not None:
            torch.set_rng_state(rng)
        for step in range(resumed, steps):
            student.train()
            batch = torch.stack([train[int(i)] for i in picks[step]]).to(device)
            loss = distill(lambda x: compiled(input_ids=x, use_cache=False), batch, batch, lm_loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter())
            train_bar.update(step + 1, f"loss {float(loss.detach()):.4f}")
            if (step + 1) % save_every == 0 and step + 1 < steps:
                torch.save({"args": args, "model": student.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step + 1, "rng": torch.get_rng_state()}, state_path + ".tmp")
                os.replace(state_path + ".tmp", state_path)  # a kill mid-write leaves the last whole state
    train_bar.close()
    student.to("cpu").eval()
    finalize(student)
    student.to(stored)  # saved in the directory's dtype (zeros stay zeros; recorded grids hold within a bf16 step)
    check = check_nm(student)
    if not check.ok:
        raise RuntimeError(f"nmcompile recover: the recovered model is not N:M:\n{check}")
    loss_after = _loss(student, evals, batch_size, "hf", bar(len(evals), "held-out loss, recovered"))
    per_step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    summary = RecoverSummary(recipe, steps, loss_teacher, loss_before, loss_after, steps * batch_size * seq_len,
                             sum(len(w) for w in evals), 0.0, per_step, device, resumed,
                             str(dtype).replace("torch.", ""), sorted(layout.weights), [], out)
    say(f"saving to {out}")
    tmp = folders.staging(out)
    try:
        written = saving.save_pretrained(student, tmp, tokenizer=tokenizer)
        summary.files = [os.path.normpath(os.path.join(out, os.path.relpath(p, tmp))) for p in written]
        summary.seconds = time.perf_counter() - start
        with open(os.path.join(tmp, RECORD), "w") as handle:
            json.dump({**args, "data": os.path.abspath(data), **dataclasses.asdict(summary)}, handle, indent=1)
        folders.replace_folder(tmp, out, keep, "nmcompile recover", keep_replaced=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(state_path):
        os.remove(state_path)
    return summary


def format_summary(s: RecoverSummary) -> str:
    gap = s.loss_before - s.loss_teacher
    closed = f"{(s.loss_before - s.loss_after) / gap:.0%} of the gap to the teacher closed" if gap > 0 else \
        "the pruned model was no worse than the teacher"
    lines = [f"nmcompile recover: {len(s.weights)} N:M weights trained {s.steps} steps with {s.recipe} on {s.device} in {s.dtype} "
             f"({s.train_tokens} tokens{f', resumed at step {s.resumed_at}' if s.resumed_at else ''}) in "
             f"{s.seconds:.1f}s, {s.seconds_per_step:.3f}s a step",
             f"  held-out loss ({s.held_out_tokens} tokens): teacher {s.loss_teacher:.4f}, pruned {s.loss_before:.4f} "
             f"-> recovered {s.loss_after:.4f} ({closed})"]
    lines += [f"  wrote {path}" for path in s.files]
    lines += ["next:", f"  nmcompile check {s.out}",
              f"  model = nmcompile.deploy.load_pretrained({s.out!r}, packed=True)   # 2:4 weights packed (CPU)"]
    return "\n".join(lines)
