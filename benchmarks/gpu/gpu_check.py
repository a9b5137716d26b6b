"""One command that checks nmcompile's whole GPU path on one GPU and writes one JSON and one markdown table.

    python benchmarks/gpu/gpu_check.py                      # about 10 minutes on one H100, results in benchmarks/results/
    python benchmarks/gpu/gpu_check.py --budget-s 300 --out-dir /tmp/check

In order, each part with its own time limit inside ``--budget-s`` (what is missing, fails or runs
out of time is recorded as such, and the next part runs):

1. environment: GPU, torch, CUDA, cuSPARSELt, whether torch-tensorrt imports;
2. the risks only a GPU can settle, the gpu-marked tests of ``tests/kernels/test_gpu_risks.py``
   (one ``pytest``; ``--risks`` picks checks by name): one cuSPARSELt algorithm id reused across
   token counts, sm90's structured and dense dims, CUDA-graph capture of the 2:4 ops, STEP's gate
   (its host syncs, and training under ``mode="reduce-overhead"``), and one step of every recipe on
   cuSPARSELt against the reference kernel (which refuses what cuSPARSELt would prune silently),
   a user's post-grad pass beside nmcompile's on this torch, and cuSPARSELt in fp16; each check's
   rows (case, status, detail) come back through a file the tests append to;
3. the other gpu-marked tests, one ``pytest`` per test file, each with its share of what is left of
   ``--tests-s`` (so that one slow file, e.g. the Inductor training compiles of test_training_modes,
   times out alone and the other files still report);
4. training speed, bf16 parameters, forward + backward (the block's input needs a gradient, as
   inside a network), CUDA-event medians interleaved (``benchmarks/toolbox.py``): one MLP block
   (Linear(d, 4d), GELU, Linear(4d, d)) at ViT-L (d 1024, 197 x 64 tokens) and GPT-2 (d 768,
   1024 x 8 tokens) shapes, ``torch.compile`` dense (Inductor) against ``backend="nmsparse"`` with
   the target recipe ``transposable:2:4,wgrad=mvue24``, ``train_kernel="cusparselt"`` and ``"auto"``
   (timed per layer and GEMM when compiling, see ``nmcompile.training.train_report``);
5. a GPT-2-small-shaped training step (12 layers, d 768, 12 heads, MLP 3072, vocab 50257, 8 x 1024
   tokens, AdamW): dense compiled against ``transposable:2:4,wgrad=mvue24`` with ``train_kernel="auto"``;
6. ``benchmarks/gpu/deploy_speed.py --quick --dtype bf16`` (the deploy kernels, three shapes and a
   4-layer decoder);
7. the other recipes' MLP blocks with ``train_kernel="cusparselt"``, while the budget lasts.

The issue's targets are listed next to what was measured (``met``, ``not met``, ``not measured``);
nothing is asserted. Without CUDA it says so, writes the JSON and the table saying that nothing was
measured, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):  # run as a file: the repository root, after the installed packages
    sys.path.append(str(Path(__file__).resolve().parents[2]))
from benchmarks.toolbox import RESULTS, ROOT, cell, gpu_env, short_error, time_interleaved  # noqa: E402

HERE = Path(__file__).resolve().parent
#: the risks only a GPU settles (part 2), one gpu-marked test per check
RISKS = "tests/kernels/test_gpu_risks.py"
PYTEST = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=line"]
TARGET = "transposable:2:4,wgrad=mvue24"
OTHER_RECIPES = ("ste:2:4", "s_ste:2:4", "transposable:2:4", "bi_mask:2:4", "sr_ste:2:4,wgrad=mvue24")
MLP_SHAPES = {"vit-l": (1024, 197 * 64), "gpt2": (768, 1024 * 8)}  # (d, tokens)
GPT2_SMALL = dict(layers=12, d=768, heads=12, hidden=3072, vocab=50257, ctx=1024)


class Clock:
    def __init__(self, budget: float):
        self.start, self.budget = time.monotonic(), budget

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)


def environment() -> dict:
    env = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
           "cusparselt": torch.backends.cusparselt.version() if torch.backends.cusparselt.is_available() else None}
    try:
        import torch_tensorrt  # noqa: F401

        env["torch_tensorrt"] = getattr(torch_tensorrt, "__version__", "importable")
    except Exception as exc:  # absent on the GPU machine: reported, never needed here
        env["torch_tensorrt"] = f"missing ({type(exc).__name__})"
    if env["cuda_available"]:
        env.update(gpu_env())
    return env


def gpu_test_files() -> list[str]:
    """The test files that hold gpu-marked tests, relative to the repository root (not :data:`RISKS`: part 2)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text() and str(p.relative_to(ROOT)) != RISKS)


def risk_rows(budget: float, out_dir: Path, only=None) -> tuple[list[dict], dict]:
    """Part 2: ``pytest -m gpu`` on :data:`RISKS` (the checks named in ``only``, or all) within
    ``budget`` seconds: the rows the tests wrote (check, case, status, detail), and the run's
    status; a run that did not pass adds a row saying so (a timeout leaves the checks after it out)."""
    if budget < 30:
        return [{"check": "all", "case": "all", "status": "skipped", "detail": "time budget"}], {}
    rows_file = out_dir / "risk_rows.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_file.unlink(missing_ok=True)
    cmd = [*PYTEST, RISKS, *(["-k", " or ".join(only)] if only else [])]
    part = run(cmd, budget, env={"GPU_CHECK_RISK_ROWS": str(rows_file)})
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    if part["status"] != 0:
        summary = next((line for line in reversed(part["tail"]) if " passed" in line or " failed" in line
                        or "error" in line or "no tests ran" in line), (part["tail"] or [""])[-1])
        rows.append({"check": "pytest", "case": " ".join(cmd[2:]), "status": f"not passed: {part['status']}",
                     "detail": summary[:200]})
    return rows, part


def has_xdist() -> bool:
    """Whether pytest-xdist is installed (the gpu-marked tests then run in 8 processes)."""
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def gpu_tests(clock: Clock, budget: float) -> dict:
    """``pytest -m gpu`` over the files that hold gpu-marked tests: one run spread over 8 processes
    where pytest-xdist is installed (the Inductor compiles dominate: 40 tests took 74 s so on an
    H200 with 16 cores), else one run per file, the time left shared among the files not yet run."""
    files = gpu_test_files()
    base = PYTEST
    if has_xdist():
        part = run([*base, "-n", "8", *files], min(budget, clock.left() - 150))
        part["cmd"] = "pytest -m gpu -n 8 (every file)"
        summary = next((line for line in reversed(part["tail"]) if " passed" in line or " failed" in line), "")
        print(f"  gpu tests: {part['status']} ({part['seconds']} s) {summary}", flush=True)
        return {**part, "files": [part]}
    started, parts = time.monotonic(), []
    for i, path in enumerate(files):
        left = min(budget - (time.monotonic() - started), clock.left() - 240)
        share = left / (len(files) - i)
        if share < 10:
            parts.append({"cmd": path, "status": "skipped: time budget", "seconds": 0, "tail": []})
            continue
        parts.append(run([*base, path], share))
        print(f"  {path}: {parts[-1]['status']} ({parts[-1]['seconds']} s)", flush=True)
    failed = [p["cmd"] for p in parts if p["status"] != 0]
    return {"cmd": "pytest -m gpu, per file", "status": 0 if not failed else f"not passed: {', '.join(failed)}",
            "seconds": round(time.monotonic() - started, 1), "files": parts,
            "tail": [f"{p['cmd']}: {p['status']} ({p['seconds']} s) {(p['tail'] or [''])[-1]}" for p in parts]}


def run(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """A subprocess's exit status, its last lines and its wall time; a timeout is a result too.
    ``env``: variables set for it, beside the repository root first on ``PYTHONPATH``."""
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1),
                              env={**os.environ, **(env or {}),
                                   "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        status, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status = "timeout"
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    tail = [line for line in text.strip().splitlines() if line.strip() and not line.startswith("DEBUG")][-40:]
    return {"cmd": " ".join(cmd), "status": status, "seconds": round(time.monotonic() - started, 1), "tail": tail}


# ---- training speed ----------------------------------------------------------------------------


def mlp_block(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))


def kernels_summary(model: nn.Module) -> tuple[str, list[float]]:
    """``nmcompile.training.train_report`` in one line (per weight: forward/dgrad/wgrad kernel and the
    speedup timed when compiling), and the timed speedups of the GEMMs given a sparse kernel."""
    from nmcompile.training import train_report

    parts, sparse = [], []
    for name, kernels in train_report(model).items():
        if isinstance(kernels, str):
            parts.append(f"{name}: {kernels}")
            continue
        decisions = kernels.as_dict().values()
        sparse += [d.speedup for d in decisions if d.sparse and d.speedup]
        parts.append(f"{name}: " + "/".join(d.kernel + (f" {d.speedup:.2f}x" if d.speedup else "") for d in decisions))
    return "; ".join(parts), sparse


def step_fn(model: nn.Module, compiled, inputs, loss=None, optimizer=None):
    """One forward + backward (+ optimizer step): gradients set to None first, as a training loop does."""
    params = [p for p in model.parameters() if p.requires_grad]
    x, dy = inputs

    def step():
        for p in params:
            p.grad = None
        if x.requires_grad:
            x.grad = None
        out = compiled(x)
        if loss is None:
            out.backward(dy)
        else:
            loss(out).backward()
        if optimizer is not None:
            optimizer.step()

    return step


GRAPHS = ", graphs"  # a variant compiled with mode="reduce-overhead" (CUDA graphs), against dense's same


def mlp_rows(recipes, kernels_for, clock: Clock, reps: int, warmup: int, graphs: bool = False) -> list[dict]:
    """Rows per shape: dense and each recipe's kernels; with ``graphs``, each again under CUDA graphs
    (cuSPARSELt plans on the host at every call, which CUDA graphs replay without)."""
    import nmcompile

    modes = (("", None), (GRAPHS, "reduce-overhead")) if graphs else (("", None),)
    rows = []
    for shape, (d, tokens) in MLP_SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        base = mlp_block(d).cuda().to(torch.bfloat16)
        torch._dynamo.reset()
        fns, reports, errors = {}, {}, {}
        for suffix, mode in modes:
            fns[f"dense{suffix}"] = step_fn(base, torch.compile(base, dynamic=False, mode=mode), (x, dy))
        for recipe in recipes:
            for kernel in kernels_for(recipe):
                for suffix, mode in modes:
                    name = f"{recipe} [{kernel}{suffix}]"
                    if clock.left() < 30:
                        errors[name] = "skipped: time budget"
                        continue
                    try:
                        model = mlp_block(d).cuda().to(torch.bfloat16)
                        model.load_state_dict(base.state_dict())
                        nmcompile.annotate(model, recipe)
                        options = {"train_kernel": kernel, **({"mode": mode} if mode else {})}
                        compiled = torch.compile(model, backend="nmsparse", dynamic=False, options=options)
                        fns[name] = step_fn(model, compiled, (x, dy))
                        fns[name]()  # compiles here, so that the report exists and a failure is this variant's
                        reports[name] = kernels_summary(model)
                    except Exception as exc:
                        errors[name] = short_error(exc)
                        fns.pop(name, None)
        times = {**errors, **time_interleaved(fns, reps=reps, warmup=warmup, inference=False)}
        for name, value in times.items():
            text, sparse = reports.get(name, ("", []))
            dense = times.get("dense" + (GRAPHS if name.endswith(GRAPHS + "]") else ""))
            rows.append({"shape": f"{shape} {tokens}x{d}->{4 * d}->{d}", "variant": name, "ms": value,
                         "vs_dense": ratio(dense, value), "kernels": text, "sparse_speedups": sparse})
        torch.cuda.empty_cache()
    return rows


def gpt2_rows(clock: Clock, reps: int, warmup: int, graphs: bool = False) -> list[dict]:
    import nmcompile
    import torch.nn.functional as F

    from benchmarks.gpu.deploy_speed import Decoder

    torch.manual_seed(0)
    ids = torch.randint(0, GPT2_SMALL["vocab"], (8, GPT2_SMALL["ctx"]), device="cuda")
    labels = torch.randint(0, GPT2_SMALL["vocab"], (8, GPT2_SMALL["ctx"]), device="cuda")
    base = Decoder(**GPT2_SMALL).cuda().to(torch.bfloat16)

    def loss(logits):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    fns, reports, errors = {}, {}, {}
    torch._dynamo.reset()
    variants = [("dense", None, None), (f"{TARGET} [auto]", "auto", None)]
    if graphs:
        variants += [(f"dense{GRAPHS}", None, "reduce-overhead"), (f"{TARGET} [auto{GRAPHS}]", "auto", "reduce-overhead")]
    for name, kernel, mode in variants:
        if clock.left() < 120:  # a 12-layer compile takes a minute
            errors[name] = "skipped: time budget"
            continue
        try:
            model = Decoder(**GPT2_SMALL).cuda().to(torch.bfloat16)
            model.load_state_dict(base.state_dict())
            if kernel is None:
                compiled = torch.compile(model, dynamic=False, mode=mode)
            else:
                nmcompile.annotate(model, TARGET, include=["blocks.*"])
                options = {"train_kernel": kernel, **({"mode": mode} if mode else {})}
                compiled = torch.compile(model, backend="nmsparse", dynamic=False, options=options)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            fns[name] = step_fn(model, compiled, (ids, None), loss=loss, optimizer=opt)
            fns[name]()
            if kernel is not None:
                reports[name] = kernels_summary(model)
        except Exception as exc:
            errors[name] = short_error(exc)
            fns.pop(name, None)
    times = {**errors, **time_interleaved(fns, reps=reps, warmup=warmup, inference=False)}
    shape = "GPT-2-small step 8x1024"
    return [{"shape": shape, "variant": k, "ms": v, "vs_dense": ratio(times.get("dense" + (GRAPHS if k.endswith(GRAPHS) or k.endswith(GRAPHS + "]") else "")), v),
             "kernels": reports.get(k, ("", []))[0], "sparse_speedups": reports.get(k, ("", []))[1]}
            for k, v in times.items()]


def ratio(dense, value) -> float | None:
    return round(dense / value, 3) if isinstance(dense, float) and isinstance(value, float) and value > 0 else None


# ---- targets and output ------------------------------------------------------------------------


def targets(result: dict) -> list[dict]:
    """Each target against every variant that measured it (plain, and under CUDA graphs against dense
    under CUDA graphs)."""
    def verdict(value, goal):
        return "not measured" if value is None else ("met" if value >= goal else "not met")

    out = []
    for shape in MLP_SHAPES:
        for r in result.get("train_mlp", []):
            if r["shape"].startswith(shape) and r["variant"].startswith(TARGET):
                out.append({"target": f"MLP block fwd+bwd, {shape}, {r['variant']} >= 1.3x dense compiled",
                            "measured": r["vs_dense"], "status": verdict(r["vs_dense"], 1.3)})
    for r in result.get("train_gpt2", []):
        if not r["variant"].startswith("dense"):
            out.append({"target": f"GPT-2-small training step, {r['variant']} >= 1.1x", "measured": r["vs_dense"],
                        "status": verdict(r["vs_dense"], 1.1)})
    linear = result.get("deploy", {}).get("linear", [])
    big = max(linear, key=lambda r: _flops(r["shape"]), default=None)
    for dense, sparse, how in (("dense", "nmsparse", ""), ("dense_graphs", "nmsparse_graphs", ", CUDA graphs both")):
        deploy = ratio(big.get(dense), big.get(sparse)) if big else None
        out.append({"target": f"deploy large GEMM >= 1.5x ({big['shape'] if big else 'n/a'}{how})", "measured": deploy,
                    "status": verdict(deploy, 1.5)})
    auto_rows = [r for r in result.get("train_mlp", []) + result.get("train_gpt2", []) if "[auto" in r["variant"]
                 and isinstance(r.get("ms"), float)]
    speedups = [s for r in auto_rows for s in r.get("sparse_speedups", [])]
    slower = [s for s in speedups if s < 1.0]
    if auto_rows and not speedups:  # every GEMM measured slower as 2:4 and stayed dense
        status = "met: auto kept every training GEMM dense (each measured slower as 2:4)"
    else:
        status = "not measured" if not speedups else ("met" if not slower else "not met")
    out.append({"target": "no layer slower than dense under auto", "measured": min(speedups) if speedups else None,
                "status": status})
    return out


def _flops(shape: str) -> int:
    try:
        tokens, rest = shape.split()[-1].split("x")
        fin, fout = rest.split("->")
        return int(tokens) * int(fin) * int(fout)
    except ValueError:
        return 0


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# nmcompile GPU check ({time.strftime('%Y-%m-%d %H:%M')})", "",
             " | ".join(f"{k}: {v}" for k, v in env.items()), ""]
    if not env.get("cuda_available"):
        return "\n".join(lines + [result["message"], ""])
    risks = result.get("risks_run")
    lines += ["## risks only a GPU settles (tests/kernels/test_gpu_risks.py)", ""]
    lines += [f"`{risks['cmd']}`: status {risks['status']} ({risks['seconds']} s)", ""] if risks else []
    lines += ["| check | case | status | detail |", "|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['case']} | {r['status']} | {r['detail']} |" for r in result.get("risks", [])]
    tests = result.get("tests", {})
    lines += ["", "## gpu-marked tests", "", f"`{tests.get('cmd', '')}`: status {tests.get('status')} "
              f"({tests.get('seconds')} s)", "", "```", *tests.get("tail", [])[-12:], "```", ""]
    lines += ["## training speed (bf16; MLP block: forward + backward; GPT-2: + AdamW step)", "",
              "| shape | variant | ms | vs dense | kernels |",
              "|---|---|---|---|---|"]
    for r in result.get("train_mlp", []) + result.get("train_gpt2", []):
        lines.append(f"| {r['shape']} | {r['variant']} | {cell(r['ms'])} | {r['vs_dense'] or '-'} | {r['kernels'] or '-'} |")
    deploy = result.get("deploy", {})
    lines += ["", "## deploy (deploy_speed.py --quick --graphs --dtype bf16)", "", f"status {deploy.get('status')}", "",
              "| shape | dense ms | nmsparse ms | vs dense | dense, graphs ms | nmsparse, graphs ms | vs dense, graphs |",
              "|---|---|---|---|---|---|---|"]
    for r in deploy.get("linear", []) + deploy.get("e2e", []):
        lines.append(f"| {r.get('shape') or r.get('case')} | {cell(r.get('dense'))} | {cell(r.get('nmsparse'))} | "
                     f"{ratio(r.get('dense'), r.get('nmsparse')) or '-'} | {cell(r.get('dense_graphs'))} | "
                     f"{cell(r.get('nmsparse_graphs'))} | {ratio(r.get('dense_graphs'), r.get('nmsparse_graphs')) or '-'} |")
    lines += ["", "## targets (issue 21)", "", "| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured'] if t['measured'] is not None else '-'} | {t['status']} |"
              for t in result["targets"]]
    return "\n".join(lines + [""])


def write(result: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    md_path.write_text(markdown(result))
    return json_path, md_path


def stage(result: dict, key: str, fn) -> None:
    """Append ``fn()``'s rows to ``result[key]``; an exception (e.g. out of memory) becomes a row."""
    try:
        rows = fn()
    except Exception as exc:
        rows = [{"shape": key, "variant": "error", "ms": f"{type(exc).__name__}: {exc}"[:200], "vs_dense": None,
                 "kernels": "", "sparse_speedups": []}]
    for row in rows:
        print(f"  {row['shape']} {row['variant']}: {row['ms']} ({row['vs_dense']}x) {row['kernels']}", flush=True)
    result.setdefault(key, []).extend(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget for all parts (default 600)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tests-s", type=float, default=240.0, help="budget of the gpu-marked tests (default 240)")
    parser.add_argument("--skip-risks", action="store_true")
    parser.add_argument("--risks", default=None, help=f"comma-separated checks of {RISKS} to run (default: all)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-deploy", action="store_true")
    args = parser.parse_args(argv)
    clock = Clock(args.budget_s)
    result = {"env": environment()}
    if not result["env"]["cuda_available"]:
        result["message"] = "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing measured"
        result["targets"] = []
        print(result["message"])
        paths = write(result, Path(args.out_dir))
        print(f"wrote {paths[0]} and {paths[1]}")
        return 0
    print(" | ".join(f"{k}: {v}" for k, v in result["env"].items()), flush=True)
    if not args.skip_risks:
        result["risks"], result["risks_run"] = risk_rows(clock.left() - 0.6 * args.budget_s, Path(args.out_dir),
                                                         only=args.risks.split(",") if args.risks else None)
        for r in result["risks"]:
            print(f"  risk {r['check']} {r['case']}: {r['status']} {r['detail']}", flush=True)
    if not args.skip_tests:
        result["tests"] = gpu_tests(clock, args.tests_s)
        print(f"gpu tests: {result['tests']['status']}", flush=True)
    if not args.skip_deploy:
        deploy_json = Path(args.out_dir) / "deploy_quick.json"
        deploy_json.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(HERE / "deploy_speed.py"), "--quick", "--graphs", "--dtype", "bf16", "--out", str(deploy_json)]
        result["deploy"] = run(cmd, timeout=min(150, clock.left() - 20))
        print("\n".join(result["deploy"]["tail"][-14:]), flush=True)
        if deploy_json.exists() and result["deploy"]["status"] == 0:
            result["deploy"].update({k: v for k, v in json.loads(deploy_json.read_text()).items() if k in ("linear", "e2e")})
        print(f"deploy: {result['deploy']['status']}", flush=True)
    stage(result, "train_mlp", lambda: mlp_rows([TARGET], lambda r: ("cusparselt", "auto"), clock, args.reps, args.warmup,
                                                graphs=True))
    stage(result, "train_gpt2", lambda: gpt2_rows(clock, max(5, args.reps // 2), 3, graphs=True))
    if clock.left() > 60:
        stage(result, "train_mlp", lambda: mlp_rows(OTHER_RECIPES, lambda r: ("cusparselt",), clock, args.reps, args.warmup))
    result["targets"] = targets(result)
    result["elapsed_s"] = round(time.monotonic() - clock.start, 1)
    for t in result["targets"]:
        print(f"target: {t['target']}: {t['measured']} -> {t['status']}")
    paths = write(result, Path(args.out_dir))
    print(f"wrote {paths[0]} and {paths[1]} ({result['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
