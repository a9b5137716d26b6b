"""``nmcompile prune MODEL --recipe sparsegpt:2:4 --calibration FILE --out DIR``: one-shot N:M pruning of a
trained causal language model from calibration text. ``MODEL`` is a local Hugging Face model directory (``config.json``, weights, tokenizer) or a
``torch.save``'d ``nn.Module`` (a ``.pt`` file of a whole model, loaded with ``weights_only=False``:
only for files you trust). Nothing is downloaded. The calibration text is tokenised with the model's
tokenizer (a ``.pt`` model: ``--tokenizer DIR``, its ``chars`` attribute for a character model, or a
``.pt`` file of token ids instead of text) and cut into ``--samples`` windows of ``--seq-len`` tokens;
held-out text (``--held-out``, else the last tenth of the calibration text, never calibrated on) gives
the evaluation loss before and after. The model is declared with the recipe (:func:`nmcompile.annotate`),
calibrated and solved by :func:`nmcompile.finalize` (one pass, or sequentially block by block on
cached block inputs when one pass's statistics would not fit in memory: the summary says which and
why), checked N:M, and saved by :func:`nmcompile.deploy.save_pretrained`: a Hugging Face directory
(safetensors, loadable without nmcompile) or ``model.pt``, plus ``nmcompile.json`` (which weight is N:M
along which dim: :func:`nmcompile.deploy.load_pretrained` loads the directory as deployed) and, for 2:4,
``model_packed.pt`` with every 2:4 weight packed, when the packed weights take at most half the memory
available and fit on the disk (otherwise a warning and ``nmcompile.json`` say why it was skipped); with
``bits=8`` (``sparsegpt:2:4,bits=8``), ``model_int8.safetensors`` with the int8 codes, positions and row scales
beside the dequantized weights (``bits=4``: ``model_int4.safetensors``, 4-bit codes and group scales). A disk that cannot take the weights is refused before calibrating.

The model keeps its own dtype (a bf16 checkpoint is calibrated and written in bf16; each weight's
solve runs in float32); ``dtype`` overrides it. The output is written to a temporary folder beside
``out`` and renamed at the end, so an interrupted prune leaves no folder that looks complete (the staging
folders of a killed run are removed by the next); ``out`` is checked before any work: it may not be the
input model (or hold it), it must be writable (a link is written through), and a non-empty ``out`` that is
not an earlier output of ``nmcompile prune`` is refused unless ``overwrite`` (which replaces the weights
files in it, as :func:`nmcompile.deploy.save_pretrained` does). A user's files in an earlier output, and
the other files of a folder given with ``overwrite``, are carried into the new one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import folders, saving
from ..checkpoint.layout import INT4_FILE, INT8_FILE, PACKED_FILE, RECORD_FILE
from ..declare.annotate import annotate
from ..deploy.finalize import finalize
from ..deploy.inspection import check as check_nm
from ..oneshot.compute_dtype import compute_dtype, raised_per_module
from ..oneshot.sequential import run_batch
from ..recipes import parse
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
    calibration: str = ""  # one pass or sequential, and why
    dtype: str = ""  # of the written weights
    out: str = ""  # the folder written
    hf: bool = True  # a Hugging Face directory (else model.pt)


#: the bars of finalize's one-shot phases (``progress(0, total, phase)`` starts each)
PHASES = {"calibration batches": "one-pass calibration, batches", "solving weights": "solving, weights",
          "inputs caught": "sequential one-shot, blocks"}
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the folder's record of a prune (also how a later prune knows it may replace the folder)
RECORD = "nmcompile-prune.json"


def _load(path: str, tokenizer_dir: str | None, dtype: str = "auto"):
    """``(model, encode, kind)``; ``encode(text) -> 1-D int64 ids`` (None: only id files)."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"{path} is a folder without config.json: not a Hugging Face model directory")
        try:
            import transformers
        except ImportError as err:
            raise ImportError("nmcompile prune on a Hugging Face directory needs transformers (pip install "
                              "transformers)") from err
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                                  dtype=DTYPES[dtype] or "auto")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir or path, local_files_only=True)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{tokenizer_dir or path}: no tokenizer could be loaded ({str(err).splitlines()[0]}); give "
                             "--tokenizer DIR (a Hugging Face tokenizer folder) or a .pt calibration file of token "
                             "ids") from err
        return model, lambda text: torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long), ("hf", tokenizer)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such model directory or file")
    model = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{path} holds a {type(model).__name__}, not a torch.save'd nn.Module; save the whole model "
                         "(torch.save(model, path)) or give a Hugging Face directory")
    if DTYPES[dtype] is not None:
        model = model.to(DTYPES[dtype])
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
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); convert it (iconv -t utf-8) or "
                         "give a .pt file of token ids") from err
    return encode(text)


def _windows(ids: torch.Tensor, seq_len: int, samples: int | None) -> list[torch.Tensor]:
    count = len(ids) // seq_len
    if samples is not None:
        count = min(count, samples)
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(count)]


def _inputs(batch: torch.Tensor, kind: str):
    """A calibration batch as the model takes it (a Hugging Face model: no key/value cache)."""
    return {"input_ids": batch, "use_cache": False} if kind == "hf" else batch


def _logits(model, batch, kind: str = "pt"):
    return getattr(out := run_batch(model, _inputs(batch, kind)), "logits", out)


#: float32 logits held at once by the loss (a 128k vocabulary at 512 tokens is 262 MB a window)
LOGIT_BYTES = 1 << 28


def _vocab(model) -> int | None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(out, "out_features", None) or getattr(getattr(model, "config", None), "vocab_size", None)


def _loss(model, windows, batch_size: int, kind: str = "pt", bar: Progress | None = None) -> float:
    """Mean next-token loss over ``windows``, in the dtype calibration computes in (one module raised
    at a time where the model's own dtype is slow on this CPU: :mod:`nmcompile.oneshot.compute_dtype`);
    ``bar`` counts the windows done."""
    total, tokens = 0.0, 0
    model.eval()
    vocab = _vocab(model) or 1
    batch_size = max(1, min(batch_size, LOGIT_BYTES // (4 * vocab * len(windows[0]))))
    with torch.no_grad(), raised_per_module(model, compute_dtype(model)[0]):
        for i in range(0, len(windows), batch_size):
            batch = torch.stack(windows[i:i + batch_size])
            logits = _logits(model, batch, kind).float()
            for row, ids in zip(logits, batch):  # row by row: a view, where a reshape of the batch would copy it
                total += float(F.cross_entropy(row[:-1], ids[1:], reduction="sum"))
            del logits
            tokens += batch[:, 1:].numel()
            if bar is not None:
                bar.update(min(i + batch_size, len(windows)))
    if bar is not None:
        bar.close()
    return total / max(tokens, 1)


def _positions(model) -> int | None:
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check_numbers(seq_len: int, samples: int | None, batch_size: int) -> None:
    for flag, value, low in (("--seq-len", seq_len, 2), ("--batch", batch_size, 1), ("--samples", samples, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value}: must be at least {low}")


def _check_ids(model, ids: torch.Tensor, seq_len: int, where: str) -> None:
    positions = _positions(model)
    if positions is not None and seq_len > positions:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {positions} positions; give --seq-len "
                         f"{positions} or less")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and len(ids) and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise ValueError(f"{where}: token ids from {int(ids.min())} to {int(ids.max())}, but the model's vocabulary has "
                         f"{vocab} (ids 0 to {vocab - 1}); the ids were made by another tokenizer")


def _output_folder(out: str, model_paths, overwrite: bool, record_name: str = RECORD,
                   command: str = "nmcompile prune") -> tuple[str, Callable[[str], bool]]:
    """Check ``out`` before any work; ``(folder, keep)``: the folder to write (through a link) and which of
    its entries the new output keeps. Refused: an input model (``model_paths``: one or a list), a folder holding
    one or inside one, a path that cannot be written, and a non-empty folder that no earlier run of ``command``
    wrote (its record ``record_name``; unless ``overwrite``). What an earlier run did not write (a user's files)
    is kept; a folder written into with ``overwrite`` loses its weights files only."""
    what = f"{command} --out"
    real_out = folders.resolve(out, what)
    for model_path in [model_paths] if isinstance(model_paths, str) else model_paths:
        real_model = os.path.realpath(model_path)
        if real_out == real_model or real_model.startswith(real_out + os.sep) or real_out.startswith(real_model + os.sep):
            raise ValueError(f"--out {out} is (or holds, or is inside) the input model {model_path}: that model would "
                             "be overwritten; give another folder")
    record = os.path.join(real_out, record_name)
    if os.path.isdir(real_out) and os.listdir(real_out) and not overwrite and not os.path.exists(record):
        raise ValueError(f"--out {out} is a non-empty folder that {command} did not write; give an empty or new "
                         "folder, or --overwrite to replace the model in it (its weights files go; other files stay)")
    folders.check_writable(real_out, what)
    folders.clean_stale(real_out, what)
    if os.path.exists(record):
        written = _written_by_earlier(record) | {record_name}
        return real_out, (lambda name: name not in written)
    return real_out, (lambda name: not saving.weight_file(name))  # --overwrite: the model in it is replaced


def _written_by_earlier(record: str) -> set[str]:
    """The names an earlier prune wrote into the folder of ``record`` (its own record among them)."""
    try:
        with open(record) as handle:
            files = json.load(handle).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    out = os.path.dirname(record)
    names = {os.path.relpath(os.path.join(out, f) if not os.path.isabs(f) else f, out).split(os.sep)[0]
             for f in files if isinstance(f, str)}
    return names


def prune_model(model_path: str, recipe: str, calibration: str, out: str, *, held_out: str | None = None,
                seq_len: int = 128, samples: int | None = 128, batch_size: int = 8, sequential: bool | None = None,
                include=None, exclude=None, tokenizer: str | None = None, inner: str | None = None,
                dtype: str = "auto", overwrite: bool = False, progress: bool = True) -> PruneSummary:
    """Prune ``model_path`` in one shot with ``recipe`` (``wanda`` or ``sparsegpt``); see the module doc.
    ``sequential``: None chooses by memory (see :func:`nmcompile.finalize`)."""
    start = time.perf_counter()
    parsed = parse(recipe)
    if not parsed.calibrated:
        raise ValueError(f"nmcompile prune takes a one-shot recipe (wanda, sparsegpt), not {parsed}; recipes that "
                         "train go through your training loop (see docs/recipes.md)")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: accepted are {', '.join(DTYPES)}")
    _check_numbers(seq_len, samples, batch_size)
    out, keep = _output_folder(out, model_path, overwrite)
    if progress:
        print(f"nmcompile prune: loading {model_path}", file=sys.stderr, flush=True)
    model, encode, (kind, hf_tokenizer) = _load(model_path, tokenizer, dtype)
    ids = _ids(calibration, encode)
    if held_out is None:
        split = int(0.9 * len(ids))
        ids, held = ids[:split], ids[split:]
    else:
        held = _ids(held_out, encode)
    _check_ids(model, ids, seq_len, calibration)
    _check_ids(model, held, seq_len, held_out or calibration)
    calib, evals = _windows(ids, seq_len, samples), _windows(held, seq_len, None)
    if not calib:
        raise ValueError(f"{calibration}: {len(ids)} calibration tokens make no window of --seq-len {seq_len}; give "
                         "more text or a shorter --seq-len")
    if not evals:
        raise ValueError(f"held-out text: {len(held)} tokens make no window of --seq-len {seq_len}; give --held-out "
                         "FILE or more calibration text")
    saving.check_disk(model, out, hf=kind == "hf", what="nmcompile prune")  # before the calibration, not after it
    model.eval()
    loss_before = _loss(model, evals, batch_size, kind, Progress(len(evals), "held-out loss, dense", enabled=progress))
    report = annotate(model, parsed, include=include, exclude=list(exclude) if exclude else None)
    if not report.annotated:
        raise ValueError(f"no weight of {model_path} takes {parsed}: {report}")
    batches = [_inputs(torch.stack(calib[i:i + batch_size]), kind) for i in range(0, len(calib), batch_size)]
    bar: list[Progress] = []

    def on_step(done: int, total: int, note: str) -> None:
        if done == 0:  # a phase starts: its own bar
            if bar:
                bar.pop().close()
            bar.append(Progress(total, PHASES.get(note, note), enabled=progress))
        if bar:
            bar[0].update(done, "" if done == 0 else note)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*recipe state for")
        finalized = finalize(model, calibration=batches, sequential=sequential,
                             calibration_options={"inner": inner} if inner else None, progress=on_step)
    if bar:
        bar.pop().close()
    check = check_nm(model)
    if not check.ok:
        raise RuntimeError(f"nmcompile prune: the pruned model is not {parsed.pattern}:\n{check}")
    loss_after = _loss(model, evals, batch_size, kind, Progress(len(evals), "held-out loss, pruned", enabled=progress))
    if progress:
        print(f"nmcompile prune: saving to {out}", file=sys.stderr, flush=True)
    tmp = folders.staging(out)
    try:
        written = saving.save_pretrained(model, tmp, tokenizer=hf_tokenizer, hf=kind == "hf")
        names = [os.path.relpath(path, tmp) for path in written]
        summary = PruneSummary(str(parsed), sorted(finalized), loss_before, loss_after, sum(len(w) for w in calib),
                               sum(len(w) for w in evals), time.perf_counter() - start,
                               [os.path.normpath(os.path.join(out, name)) for name in names], dict(finalized.fallbacks),
                               dict(report.skipped), finalized.calibration, str(_dtype_of(model)).replace("torch.", ""),
                               out, kind == "hf")
        with open(os.path.join(tmp, RECORD), "w") as handle:
            json.dump({"source": os.path.abspath(model_path), **dataclasses.asdict(summary)}, handle, indent=1)
        folders.replace_folder(tmp, out, keep, "nmcompile prune", keep_replaced=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _dtype_of(model) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

def file_role(name: str) -> str:
    """What a file of a pruned folder is for: "ship" (any server), "ship for CPU serving", "ship for dense loads..."."""
    roles = {
        RECORD: "this run's record (source, recipe, losses, files): not needed to serve",
        PACKED_FILE: "ship for CPU serving: every weight, the 2:4 ones packed; what load_pretrained(packed=True) "
                     "reads (the safetensors files are not needed for it)",
        RECORD_FILE: "ship: the layout record load_pretrained and check read",
        INT8_FILE: "ship for CPU serving: the 2:4 weights' int8 codes, positions and row scales that "
                   "load_pretrained(packed=True) reads",
        INT4_FILE: "ship for CPU serving: the 2:4 weights' 4-bit codes, positions and group scales that "
                   "load_pretrained(packed=True) reads",
        "model.pt": "ship: the whole model, its deploy records with it",
    }
    if name.endswith((".safetensors", ".safetensors.index.json", ".bin")) and name not in (INT8_FILE, INT4_FILE):
        return ("ship for dense loads, GPUs and other runtimes: the pruned weights dense (zeros stored, the dense "
                "model's bytes); load_pretrained(packed=True) packs them while loading where no packed file is there")
    return roles.get(name, "ship: the model's configuration or tokenizer")


def _file_lines(s: PruneSummary) -> list[str]:
    """Every file written, its size and role, then the bytes to ship for each kind of server."""
    sizes = {path: os.path.getsize(path) if os.path.isfile(path) else 0 for path in s.files}
    record = os.path.join(s.out, RECORD) if s.out else None
    if record and os.path.isfile(record) and record not in sizes:
        sizes[record] = os.path.getsize(record)
    width = max((len(path) for path in sizes), default=0)
    roles = {path: file_role(os.path.basename(path)) for path in sizes}
    lines = [f"  wrote {path.ljust(width)}  {size / 2**20:9.1f} MB  {roles[path]}" for path, size in sizes.items()]
    common, cpu, dense = (sum(sizes[p] for p, role in roles.items() if role.startswith(kind))
                          for kind in ("ship:", "ship for CPU", "ship for dense"))
    cpu += dense if PACKED_FILE not in map(os.path.basename, sizes) else 0  # no packed file: a packed load reads them
    lines.append(f"  to serve on a CPU (load_pretrained(packed=True)): {(common + cpu) / 2**20:.1f} MB" + (
        f", {(common + cpu) / (common + dense):.2f}x of the {(common + dense) / 2**20:.1f} MB that dense loads, GPUs "
        "and other runtimes need" if dense else "") + f"; {sum(sizes.values()) / 2**20:.1f} MB written")
    return lines


def format_summary(s: PruneSummary) -> str:
    lines = [
        f"nmcompile prune: {len(s.pruned)} weights pruned {s.recipe} from {s.calibration_tokens} calibration tokens "
        f"in {s.seconds:.1f}s ({s.dtype})",
        f"  calibration: {s.calibration}",
        f"  held-out loss ({s.held_out_tokens} tokens): dense {s.loss_before:.4f} (ppl {math.exp(min(s.loss_before, 50)):.2f})"
        f" -> pruned {s.loss_after:.4f} (ppl {math.exp(min(s.loss_after, 50)):.2f})",
    ]
    lines += [f"  ! {note}" for notes in s.fallbacks.values() for note in notes]
    lines += [f"  - {name}: left dense, {why}" for name, why in s.skipped.items()]
    lines += _file_lines(s)
    if s.out and s.hf:
        lines += [
            "next:",
            f"  nmcompile check {s.out}                      # every recorded weight is N:M along its dim",
            f"  model = nmcompile.deploy.load_pretrained({s.out!r}, packed=True)   # 2:4 weights packed (CPU), no dense copy",
            "  model.forward = torch.compile(model.forward, backend='nmsparse'); model.generate(ids, max_new_tokens=64)",
        ]
    elif s.out:
        lines += ["next:", f"  model = torch.load({os.path.join(s.out, 'model.pt')!r}, weights_only=False)  # records travel "
                  "with it; torch.compile(model, backend='nmsparse') deploys it"]
    return "\n".join(lines)
