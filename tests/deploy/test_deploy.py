"""The deploy pass: per-layer kernel decisions, the rewrite to nmsparse::sparse_linear, cache keys.

On CPU the rewrite is checked with the ``reference`` kernel (packed 2:4 weight, dense GEMM): same
graph as on CUDA, where the op calls cuSPARSELt. The CUDA test runs where a GPU is present.
"""

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.backends.deploy_runner import DeployRunner
from nmcompile.kernels import cpu24
from nmcompile.kernels.dispatch import qualify
from nmcompile.backends.inductor_cache import CacheKeyPass, with_cache_key
from nmcompile.backends.nmsparse import nmsparse_backend
from nmcompile.deploy.finalize import deployed_of
from nmcompile.state.records import owners

SPARSE_OP = torch.ops.nmsparse.sparse_linear.default


def finalized_mlp(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 10))
    nmcompile.annotate(model, "sr_ste:2:4")
    nmcompile.finalize(model)
    return model.to(dtype).eval()


def compile_spy(model, **options):
    """``torch.compile`` through the nmsparse backend, keeping the runner it returns."""
    runners = []

    def backend(gm, example_inputs):
        runner = nmsparse_backend(gm, example_inputs, options=options)
        runners.append(runner)
        return runner

    return torch.compile(model, backend=backend), runners


def sparse_calls(runner) -> list:
    assert isinstance(runner, DeployRunner)
    graph_module = runner.compiled.__self__  # inner="eager": the rewritten GraphModule's forward
    return [n for n in graph_module.graph.nodes if n.target is SPARSE_OP]


def test_cpu_auto_times_each_layer_and_reports_why():
    model = finalized_mlp()
    x = torch.randn(8, 64)
    with torch.no_grad():
        out = torch.compile(model, backend="nmsparse")(x)
        torch.testing.assert_close(out, model(x))
    report = nmcompile.deploy_report(model)
    for name in ("0.weight", "2.weight", "4.weight"):  # [10, 32] too: the CPU kernel takes any out_features
        decision = report[name]
        if cpu24.status().available:
            assert decision.kernel in ("cpu24", "dense") and decision.ratios[0][0] == 8, decision  # timed at 8 tokens
            assert "measured" in str(decision) or "F.linear time (same dtype and threads) / sparse time at 8 tokens: " in str(decision)
        else:
            assert decision.kernel == "dense" and decision.reason == cpu24.status().reason
    assert nmcompile.deploy_report(finalized_mlp()) == {n: "not compiled yet" for n in ("0.weight", "2.weight", "4.weight")}


def test_reference_kernel_rewrites_each_qualifying_linear_and_keeps_the_function():
    model = finalized_mlp()
    compiled, runners = compile_spy(model, inner="eager", deploy_kernel="reference")
    x = torch.randn(8, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    calls = sparse_calls(runners[0])
    assert len(calls) == 2  # 0 and 2; 4 is [10, 32]
    assert all(call.args[5] == "reference" for call in calls)
    # the compressed weights are graph inputs that never move: marked static, so that CUDA graphs
    # (mode="reduce-overhead") read them in place instead of copying them in at every replay
    packed = [call.args[2] for call in calls] + [call.args[3] for call in calls]
    assert all(n.op == "placeholder" and n.meta["tensor_dict"]["_dynamo_static_input_type"] for n in packed)
    report = nmcompile.deploy_report(model)
    assert [report[n].kernel for n in ("0.weight", "2.weight", "4.weight")] == ["reference", "reference", "dense"]


@pytest.mark.inductor
def test_inductor_compiles_the_rewritten_graph():
    model = finalized_mlp()
    compiled = torch.compile(model, backend="nmsparse", options={"deploy_kernel": "reference"})
    x = torch.randn(5, 3, 64)  # tokens over two leading dims
    with torch.no_grad():
        compiled(x)  # compiles
        with torch.profiler.profile() as prof:
            out = compiled(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-4)
    calls = [e for e in prof.events() if e.name == "nmsparse::sparse_linear"]
    outer = [e for e in calls if e.cpu_parent is None or e.cpu_parent.name != e.name]  # not its dispatch layers
    assert len(outer) == 2, [e.cpu_parent.name if e.cpu_parent else None for e in calls]


def test_a_changed_weight_is_compressed_again_and_a_broken_one_is_refused():
    model = finalized_mlp()
    compiled, _ = compile_spy(model, inner="eager", deploy_kernel="reference")
    x = torch.randn(4, 64)
    with torch.no_grad():
        compiled(x)
        model[0].weight.mul_(2.0)  # still 2:4
        torch.testing.assert_close(compiled(x), model(x))
        model[0].weight.fill_(1.0)  # no longer 2:4
        with pytest.raises(ValueError, match="more than 2 non-zeros"):
            compiled(x)


def test_eval_mode_with_gradients_still_differentiates():
    model = finalized_mlp()
    compiled = torch.compile(model, backend="nmsparse", options={"deploy_kernel": "reference", "inner": "aot_eager"})
    x = torch.randn(4, 64, requires_grad=True)
    compiled(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    dx = x.grad.clone()
    model.zero_grad()
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(x.grad, dx)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n])


@pytest.mark.parametrize(
    "weight,kw,kernel,reason",
    [
        (torch.ones(32, 32), {}, "dense", "not 2:4"),
        ("24", {"device_type": "mps"}, "dense", "no 2:4 kernel on mps"),
        ("24", {"device_type": "cuda", "cusparselt_available": False}, "dense", "no cuSPARSELt"),
        ("24", {"device_type": "cuda", "cusparselt_available": True, "capability": (9, 0)}, "dense", "cast the model to fp16 or bf16"),
        ("24h", {"device_type": "cuda", "cusparselt_available": True, "capability": (9, 0)}, "cusparselt", "qualifies"),
        ("24h", {"device_type": "cuda", "cusparselt_available": True, "capability": (7, 5)}, "dense", "this GPU is sm75"),
        ("24h-odd", {"device_type": "cuda", "cusparselt_available": True, "capability": (9, 0)}, "dense", "not a multiple of 16"),
    ],
)
def test_qualify_rules(weight, kw, kernel, reason):
    if isinstance(weight, str):
        shape = (48, 40) if weight.endswith("odd") else (32, 64)
        w = nmcompile.masks.prune(torch.randn(shape), 2, 4, 1)
        weight = w.half() if "h" in weight else w
    decision = qualify(weight, "auto", **kw)
    assert decision.kernel == kernel and reason in decision.reason


def test_forcing_cusparselt_where_it_cannot_run_is_an_error():
    model = finalized_mlp()
    with pytest.raises(Exception, match="deploy_kernel='cusparselt' cannot be used: no 2:4 kernel on cpu"):
        torch.compile(model, backend="nmsparse", options={"deploy_kernel": "cusparselt"})(torch.randn(2, 64))
    torch.compiler.reset()
    with pytest.raises(Exception, match="deploy_kernel='cpu24' cannot be used: it is the CPU kernel"):
        qualify(nmcompile.masks.prune(torch.randn(32, 64), 2, 4, 1), "cpu24", device_type="cuda")
    with pytest.raises(Exception, match="deploy_kernel='fast' is not one of"):
        torch.compile(model, backend="nmsparse", options={"deploy_kernel": "fast"})(torch.randn(2, 64))


def test_cache_key_covers_version_code_and_plan():
    a, b = CacheKeyPass("plan a"), CacheKeyPass("plan b")
    assert a.uuid() != b.uuid() and a.uuid() == CacheKeyPass("plan a").uuid()
    patches = with_cache_key({}, "p")
    assert isinstance(patches["post_grad_custom_post_pass"], CacheKeyPass)
    theirs = CacheKeyPass("user")
    merged = with_cache_key({"post_grad_custom_post_pass": theirs}, "p")["post_grad_custom_post_pass"]
    # one callable pass (torch 2.11 calls the setting; only 2.13 takes a list) running theirs, then ours
    assert callable(merged) and merged.passes[0] is theirs and isinstance(merged.passes[1], CacheKeyPass)
    assert merged.uuid() != with_cache_key({"post_grad_custom_post_pass": CacheKeyPass("other")}, "p")[
        "post_grad_custom_post_pass"].uuid()
    seen = []
    assert with_cache_key({"post_grad_custom_post_pass": [seen.append]}, "p")["post_grad_custom_post_pass"].uuid() is None
    with_cache_key({"post_grad_custom_post_pass": [seen.append]}, "p")["post_grad_custom_post_pass"]("graph")
    assert seen == ["graph"]


SECOND_PROCESS = """
import json, sys, torch, nmcompile
from torch import nn
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
nmcompile.annotate(model, "sr_ste:2:4")
if sys.argv[1] == "trained":  # the training graphs: forward and backward
    torch.compile(model, backend="nmsparse")(torch.randn(8, 256)).sum().backward()
else:
    nmcompile.finalize(model.eval(), force=sys.argv[1] == "forced")  # forced: packed; measured: timed, cached
    if sys.argv[1] == "forced":
        nmcompile.deploy.pack_weights(model, measure=False)  # every token count: no timing decides the graph
    with torch.no_grad():
        torch.compile(model, backend="nmsparse")(torch.randn(1, 256))
graph = {k: [d.kernel, d.max_tokens] for k, d in nmcompile.deploy.deploy_report(model).items()} \
    if sys.argv[1] == "measured" else {}
print(json.dumps({"counters": dict(counters["inductor"]), "graph": graph}))
"""


@pytest.mark.inductor
@pytest.mark.parametrize("form", ["forced", "measured", "trained"])
def test_a_second_process_takes_the_compiled_graph_from_inductors_cache(tmp_path, form):
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "NMCOMPILE_CACHE_DIR": str(tmp_path)}
    seen = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", SECOND_PROCESS, form], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        seen.append(json.loads(run.stdout.strip().splitlines()[-1]))
    (first, graph1), (second, graph2) = ((out["counters"], out["graph"]) for out in seen)
    # nothing in the key may refuse to pickle (the decomposition table once did: every graph bypassed)
    assert "fxgraph_cache_bypass" not in first and first.get("fxgraph_cache_miss", 0) >= 1, first
    if graph1 != graph2:
        # measured (the only form that prints its decisions): a decision timed on a noisy machine is not stored,
        # so the second process timed again and decided another graph, which has another cache key
        pytest.skip(f"the two processes timed different kernel decisions ({graph1} then {graph2}): a noisy machine")
    assert second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"] and "fxgraph_cache_miss" not in second, second


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cusparselt_rewrite_on_cuda(dtype):
    if not torch.backends.cusparselt.is_available():
        pytest.skip("this torch build has no cuSPARSELt")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    nmcompile.annotate(model, "ste:2:4")
    nmcompile.finalize(model)
    model = model.to("cuda", dtype).eval()
    x = torch.randn(4096, 1024, device="cuda", dtype=dtype)
    with torch.no_grad():
        out = torch.compile(model, backend="nmsparse", options={"deploy_kernel": "cusparselt"})(x)
        torch.testing.assert_close(out, model(x), atol=2e-2, rtol=2e-2)
    report = nmcompile.deploy_report(model)
    assert all(d.kernel in ("cusparselt", "dense") for d in report.values()), report


def test_dynamic_token_counts_and_a_graph_that_also_trains():
    model = finalized_mlp()
    compiled = torch.compile(model, backend="nmsparse", dynamic=True, options={"deploy_kernel": "reference"})
    with torch.no_grad():
        for batch in (3, 7, 11):
            x = torch.randn(batch, 64)
            torch.testing.assert_close(compiled(x), model(x))
    mixed = finalized_mlp().train()
    nmcompile.annotate(mixed, "ste:2:4", include=["4.weight"])  # trains again; 0 and 2 stay finalized
    assert set(nmcompile.deploy_report(mixed)) == {"0.weight", "2.weight"}
    torch.compiler.reset()
    with pytest.warns(UserWarning, match="0.weight, 2.weight are finalized but this graph also trains recipes"):
        torch.compile(mixed, backend="nmsparse", options={"inner": "aot_eager"})(torch.randn(4, 64))


@pytest.mark.slow
def test_gpt2_conv1d_addmm_weights_are_rewritten_through_their_transpose():
    transformers = pytest.importorskip("transformers")
    from models import _gpt2

    model = _gpt2(transformers)
    nmcompile.annotate(model, "ste:2:4")
    nmcompile.finalize(model)
    model.eval()
    compiled, runners = compile_spy(model, inner="eager", deploy_kernel="reference")
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
    report = nmcompile.deploy_report(model)
    assert len(report) == 8 and all(d.kernel == "reference" for d in report.values()), report
    assert len(sparse_calls(runners[0])) == 8  # c_attn, c_proj, c_fc, c_proj in both blocks


def test_break_even_token_count():
    from nmcompile.kernels.dispatch import break_even

    ladder = (1, 16, 64, 256)
    assert break_even(ladder, [True, True, True, True]) == 0
    assert break_even(ladder, [False, False, True, True]) == 64
    assert break_even(ladder, [True, False, True, True]) == 64  # faster at 1 token alone does not count
    assert break_even(ladder, [False, False, False, True]) == 256


def _deployed(model) -> dict:
    return {n: deployed_of(*places[0][1:]) for n, places in owners(model)}


def _rewritten(model) -> list:
    compiled, runners = compile_spy(model, inner="eager", deploy_kernel="reference")
    x = torch.randn(8, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    return [call.args[0].name for call in sparse_calls(runners[0])]


def test_deepcopy_and_assign_loads_keep_the_deploy_record():
    import copy

    model = finalized_mlp()
    records = _deployed(model)
    twin = copy.deepcopy(model)
    assert _deployed(twin) == records
    assert all(twin_p is not p for twin_p, p in zip(twin.parameters(), model.parameters()))
    assert all(_deployed(twin)[n] is not records[n] for n in records if records[n] is not None)
    assert len(_rewritten(twin)) == 2  # the copy deploys with the 2:4 kernel, as the original does
    assigned = copy.deepcopy(model)
    assigned.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert assigned[0].weight is not twin[0].weight and _deployed(assigned) == records
    nmcompile.annotate(twin, "sr_ste:2:4")  # the copy trains again: its record and load hook go
    assert all(r is None for r in _deployed(twin).values())
    twin.load_state_dict(twin.state_dict(), assign=True)
    assert all(r is None for r in _deployed(twin).values())
    assert _deployed(model) == records  # the original keeps its own


def test_a_finalized_checkpoint_loaded_into_a_fresh_model_is_recorded_with_its_pattern():
    trained = finalized_mlp()
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    state["2.weight"][0, :4] = 1.0  # one group of one layer is no longer 2:4
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
    fresh.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"nmcompile.finalize\(model, pattern='2:4'\) records its N:M weights"):
        with torch.no_grad():
            torch.compile(fresh, backend="nmsparse")(torch.randn(8, 64))  # nothing records it as N:M yet
    assert nmcompile.deploy_report(fresh) == {}
    report = nmcompile.finalize(fresh, pattern="2:4")
    assert set(report) == {"0.weight", "4.weight"}
    assert report.dense == {"2.weight": "1/1024 groups along dim 1 keep more than 2 of 4"}
    assert "0.weight: 2:4 along dim 1 (loaded N:M)" in str(report)
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())  # nothing changed
    assert len(_rewritten(fresh)) == 1  # 0.weight; 4.weight is [10, 32]
    assert nmcompile.finalize(fresh, pattern="2:4") == report  # idempotent


def test_recording_a_pattern_no_weight_has_is_an_error_that_names_the_weights():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with pytest.raises(ValueError, match=r"no weight of Sequential is 2:4(.|\n)*0.weight: 512/512 groups"):
        nmcompile.finalize(model, pattern="2:4")
    with pytest.raises(ValueError, match="'2-4' is not an N:M pattern like '2:4'"):
        nmcompile.finalize(model, pattern="2-4")
    assert all(r is None for r in _deployed(model).values())
