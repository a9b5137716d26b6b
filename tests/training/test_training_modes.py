"""Training modes around the backend: mixed precision, activation checkpointing, gradient
accumulation and dynamic shapes, for the recipes of the README's table.

- **Mixed precision.** Under ``torch.autocast`` every recipe trains (finite loss, gradients on the
  float32 weights, N:M effective weights), its GEMMs run in the autocast dtype (nmcompile's own
  ``nmsparse::linear``, which MVUE, FP8 and Bi-Mask route through, included), and one step of the
  deterministic recipes is close to the float32 step. A model cast to bfloat16 before ``annotate``
  trains too. The CUDA cases (fp16 and bf16) carry the ``gpu`` marker.
- **Activation checkpointing.** Weights used inside ``torch.utils.checkpoint`` are sparsified
  (Dynamo passes them into the checkpoint's body) and give the same gradients, bit for bit, as
  without checkpointing, while the checkpointed activation is still not saved. MVUE draws its
  random numbers in the backward, which is never replayed: compiled, the partitioner recomputes
  only the checkpointed forward nodes, which draw nothing (so ``preserve_rng_state`` has nothing to
  preserve), and with the same seed the MVUE gradient is identical too.
- **Gradient accumulation.** Schedules run on optimizer steps; SR-STE's decay term is added on
  every backward pass.
- **Dynamic shapes.** nmsparse compiles exactly as often as ``aot_eager`` (static, then dynamic);
  SDGF, whose frames change shapes, refuses a frame change in a dynamic graph with a clear error.
"""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import nmcompile

AOT = {"inner": "aot_eager"}

# Every recipe, with schedules short enough that after one optimizer step every effective weight
# is N:M (STEP has switched, MDGF is in its binary phase, SDGF in its last frame).
RECIPES = {
    "ste": "ste:2:4",
    "sr_ste": "sr_ste:2:4,decay=0.05",
    "s_ste": "s_ste:2:4",
    "s_ste_mvue24": "s_ste:2:4,wgrad=mvue24",
    "step": "step:2:4,total_steps=2,t_min=0,t_max=0.5",
    "mdgf": "mdgf:2:4,decay_coef=0.3,finetune_fraction=0.5,total_steps=2",
    "sdgf": "sdgf:2:4,total_steps=2",
    "bi_mask": "bi_mask:2:4,every=1,candidates=4",
    "transposable": "transposable:2:4,every=1",
    "asp": "asp:2:4",
}
RANDOM = {"s_ste_mvue24"}  # MVUE draws: no step-for-step comparison between precisions
LOW_PRECISION = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
]


def mlp(seed=0, width=64, out=8, layers=2):
    torch.manual_seed(seed)
    mods = [nn.Linear(32, width), nn.Tanh()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(width, out))


def data(device="cpu", dtype=torch.float32, batch=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch, 6, 32, generator=g), torch.randn(batch, 6, 8, generator=g)
    return x.to(device, dtype), y.to(device)


def build(spec, inner="aot_eager", device="cpu", dtype=None, optim=torch.optim.Adam, **kw):
    model = mlp(**kw).to(device)
    if dtype is not None:
        model = model.to(dtype)  # before annotate: recipe state is made from the cast weights
    nmcompile.annotate(model, spec)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": inner})
    opt = optim(model.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(model, opt)
    return model, compiled, opt


def weights(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("weight")}


def assert_trained_step(model, loss, param_dtype):
    assert torch.isfinite(loss), f"loss {loss}"
    for name, p in weights(model).items():
        assert p.grad is not None and p.grad.dtype == param_dtype, f"{name}: gradient {p.grad}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{name}: gradient does not reach it"


def autocast_run(spec, device, dtype, inner="aot_eager", steps=2):
    """Loss and gradients of each step, with ``dtype`` autocast (``None``: float32)."""
    model, compiled, opt = build(spec, inner, device)
    x, y = data(device)
    record = []
    for _ in range(steps):
        with torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            out = compiled(x)
        assert out.dtype == (dtype or torch.float32), "the GEMMs do not run in the autocast dtype"
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        assert_trained_step(model, loss, torch.float32)
        record.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    assert nmcompile.check(model).ok, "effective weights are not N:M"
    return record


def assert_close_to_float32(low, full):
    """One step: bf16 rounds to 8 significant bits, so allow a few percent."""
    (loss, grads), (loss32, grads32) = low[0], full[0]
    torch.testing.assert_close(loss, loss32, rtol=2e-3, atol=0)
    for name, g in grads32.items():
        err = ((grads[name] - g).norm() / g.norm()).item()
        assert err < 2e-2, f"{name}: relative gradient error {err:.3g} against float32"


@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
@pytest.mark.parametrize("name", list(RECIPES))
def test_autocast_trains_every_recipe(name, device, dtype):
    low = autocast_run(RECIPES[name], device, dtype)
    if name not in RANDOM:
        assert_close_to_float32(low, autocast_run(RECIPES[name], device, None, steps=1))


@pytest.mark.inductor
@pytest.mark.slow
def test_autocast_under_inductor():
    """Inductor decomposes nmsparse::linear (Bi-Mask's GEMM) after autocast has cast its inputs."""
    low = autocast_run(RECIPES["bi_mask"], "cpu", torch.bfloat16, inner="inductor", steps=1)
    assert_close_to_float32(low, autocast_run(RECIPES["bi_mask"], "cpu", None, steps=1))


@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
@pytest.mark.parametrize("name", list(RECIPES))
def test_low_precision_weights_train(name, device, dtype):
    # Adam's default eps=1e-8 is zero in float16, and ASP's masked gradients would divide 0 by 0
    adam = functools.partial(torch.optim.Adam, eps=1e-3)
    model, compiled, opt = build(RECIPES[name], device=device, dtype=dtype, optim=adam)
    x, y = data(device, dtype)
    for _ in range(2):
        out = compiled(x)
        assert out.dtype == dtype
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        assert_trained_step(model, loss, dtype)
        opt.step()
        opt.zero_grad()
    assert nmcompile.check(model).ok
    assert all(w.dtype == dtype for w in nmcompile.effective_weights(model).values())


# ---- activation checkpointing ----


class Checkpointed(nn.Module):
    HIDDEN = (4, 6, 48)  # the activation inside the block: saved only without checkpointing

    def __init__(self, use_checkpoint):
        super().__init__()
        torch.manual_seed(0)
        self.use_checkpoint = use_checkpoint
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 48), nn.Linear(48, 32), nn.Linear(32, 8)

    def block(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=False) if self.use_checkpoint else self.block(x)
        return self.fc3(h)


def checkpoint_run(spec, use_checkpoint, seed=123):
    model = Checkpointed(use_checkpoint)
    nmcompile.annotate(model, spec)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(model, opt)
    x, y = data()
    grads, saved = [], []
    for _ in range(2):
        torch.manual_seed(seed)  # MVUE's draws
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss = F.mse_loss(compiled(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    assert nmcompile.check(model).ok
    return grads, saved


CHECKPOINT_RECIPES = {**RECIPES, "ste_mvue12": "ste:2:4,wgrad=mvue12", "s_ste_fp8": "s_ste:2:4,wgrad=mvue24,fp8=true"}


@pytest.mark.parametrize("name", list(CHECKPOINT_RECIPES))
def test_checkpointed_gradients_equal_plain(name):
    """Bit-identical gradients over two steps; for MVUE with the same seed (see the module docstring)."""
    spec = CHECKPOINT_RECIPES[name]
    plain, saved_plain = checkpoint_run(spec, False)
    ckpt, saved_ckpt = checkpoint_run(spec, True)
    assert Checkpointed.HIDDEN in saved_plain and Checkpointed.HIDDEN not in saved_ckpt, "checkpointing lost"
    for step, (a, b) in enumerate(zip(plain, ckpt)):
        for n in a:
            assert torch.equal(a[n], b[n]), f"step {step}: {n} differs with checkpointing"
    if "mvue" in spec:  # the draws matter: another seed gives another weight gradient
        other, _ = checkpoint_run(spec, True, seed=7)
        assert not torch.equal(other[0]["fc1.weight"], ckpt[0]["fc1.weight"])


# ---- gradient accumulation ----

T = 6
SCHEDULES = {  # weight of mlp(layers=4) -> recipe; every transition falls inside T steps
    "0.weight": "step:2:4,total_steps=6,t_min=0.5,t_max=0.5",  # switches at optimizer step 3
    "2.weight": "sdgf:1:8,total_steps=6",  # 7:8, then 4:8 from step 1, 2:8 from 3, 1:8 from 4
    "4.weight": "bi_mask:2:4,every=2,candidates=8,decay=0",  # permutation searched at 2, 4, 6
    "6.weight": "transposable:2:4,every=2,decay=0",  # mask refreshed at 2, 4, 6 (decay: once per backward, below)
    "8.weight": "mdgf:2:4,decay_coef=0.3,finetune_fraction=0.5,total_steps=6",  # binary from step 3
}


def accumulated_run(k, distinct=False):
    """T optimizer steps, each over ``k`` micro-batches with losses divided by k; after each step the
    state dict and effective weights. The micro-batches are copies of one batch unless ``distinct``.
    """
    model, compiled, opt = build(SCHEDULES, optim=torch.optim.AdamW, layers=4)
    states = []
    for _ in range(T):
        for i in range(k):
            x, y = data(seed=1 + i if distinct else 1)
            (F.mse_loss(compiled(x), y) / k).backward()
        opt.step()
        opt.zero_grad()
        eff = nmcompile.effective_weights(model)
        states.append({**{key: v.clone() for key, v in model.state_dict().items()},
                       **{f"eff.{n}": w.detach().clone() for n, w in eff.items()}})
    return states


def transitions(states):
    """What the schedules did after each optimizer step: clocks, STEP's phase, kept fractions."""
    def kept(w):
        return [(s[f"eff.{w}"] != 0).float().mean().item() for s in states]

    refreshed = {}
    for key in ("4.weight_nm_perm", "6.weight_nm_mask"):  # refreshes that changed something
        refreshed[key] = {i + 1 for i in range(1, T) if not torch.equal(states[i][key], states[i - 1][key])}
        assert refreshed[key] and refreshed[key] <= {2, 4, 6}, f"{key} changed after steps {refreshed[key]}"
    return {
        "clocks": {w: [int(s[f"{w}_nm_step"]) for s in states] for w in SCHEDULES},
        "phase": [bool(s["0.weight_nm_phase"]) for s in states],
        "switch_step": int(states[-1]["0.weight_nm_switch_step"]),
        "kept": {w: kept(w) for w in ("0.weight", "2.weight", "8.weight")},
    }


EXPECTED = {
    "clocks": {w: [1, 2, 3, 4, 5, 6] for w in SCHEDULES},  # optimizer steps, not forwards
    "phase": [False, False, True, True, True, True],
    "switch_step": 3,
    "kept": {
        "0.weight": [1, 1, 0.5, 0.5, 0.5, 0.5],  # STEP: dense, then 2:4
        "2.weight": [4 / 8, 4 / 8, 2 / 8, 1 / 8, 1 / 8, 1 / 8],  # SDGF's frames
        "8.weight": [1, 1, 0.5, 0.5, 0.5, 0.5],  # MDGF's alpha reaches 0 at step 3
    },
}


@pytest.mark.slow
def test_schedules_follow_optimizer_steps_not_forwards():
    """Halving is exact in floating point, so 2 copies of a batch with halved losses accumulate the
    single batch's gradient bit for bit: such a run may differ only through the schedules, and must
    not. With 3 distinct micro-batches the transitions still come at the same optimizer steps.
    """
    plain = accumulated_run(1)
    assert transitions(plain) == EXPECTED
    for i, (a, b) in enumerate(zip(plain, accumulated_run(2))):
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} after optimizer step {i + 1} differs with 2 micro-batches"
    assert transitions(accumulated_run(3, distinct=True)) == EXPECTED


DECAY = {
    "sr_ste": ("sr_ste:2:4,decay=0.1", "sr_ste:2:4,decay=0"),
    "bi_mask": ("bi_mask:2:4,decay=0.1,candidates=4", "bi_mask:2:4,decay=0,candidates=4"),
    "step": ("step:2:4,total_steps=10,decay=0.1", "step:2:4,total_steps=10"),
    "transposable": ("transposable:2:4,decay=0.1", "transposable:2:4,decay=0"),
}


def micro_batch_gradients(spec, k, phase2=False):
    model = mlp()
    nmcompile.annotate(model, spec)
    for module in model.modules() if phase2 else ():  # STEP after its switch
        if hasattr(module, "weight_nm_phase"):
            module.weight_nm_phase.fill_(True)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    for i in range(k):
        x, y = data(seed=10 + i)
        (F.mse_loss(compiled(x), y) / k).backward()
    eff = {n: w.detach() for n, w in nmcompile.effective_weights(model).items()}
    return {n: p.grad for n, p in weights(model).items()}, eff, weights(model)


@pytest.mark.parametrize("name", list(DECAY))
def test_decay_term_is_added_on_every_backward(name):
    """SR-STE's ``decay * (1 - m) * W`` is added to the gradient by each backward pass, as in the
    paper's reference implementation: with k micro-batches (losses divided by k) the accumulated
    gradient is the dense part plus k times the term. Users who accumulate k micro-batches per
    optimizer step should declare ``decay/k`` to keep the strength per optimizer step.
    """
    k, decay = 3, 0.1
    with_decay, without = DECAY[name]
    phase2 = name == "step"
    grads, eff, w = micro_batch_gradients(with_decay, k, phase2)
    dense, _, _ = micro_batch_gradients(without, k, phase2)
    for n in grads:
        term = decay * (w[n].detach() - eff[n])  # decay * (1 - m) * W
        assert term.abs().sum() > 0.1 * dense[n].abs().sum(), "the term is too small to tell k from 1"
        torch.testing.assert_close(grads[n], dense[n] + k * term, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(grads[n], dense[n] + term, rtol=1e-3, atol=1e-5)


def test_step_decay_only_in_phase_two():
    """STEP's SR-STE term belongs to its mask-learning phase: the dense phase gets the plain gradient."""
    grads, _, _ = micro_batch_gradients(DECAY["step"][0], 1)
    dense, _, _ = micro_batch_gradients(DECAY["step"][1], 1)
    for n in grads:
        assert torch.equal(grads[n], dense[n]), f"{n}: decay term applied in STEP's dense phase"


# ---- dynamic shapes ----

SHAPES = [(2, 8), (3, 5), (5, 12), (4, 7), (6, 4), (3, 3)]  # [batch, seq]: never 0 or 1 (specialized)


def shapes_run(spec, backend, inner="aot_eager"):
    """Train over SHAPES; return the compile counts and the last output with its eager reference."""
    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    if spec:
        nmcompile.annotate(model, spec)
    options = {"options": {"inner": inner}} if backend == "nmsparse" else {}
    compiled = torch.compile(model, backend=backend, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nmcompile.hook_optimizer(model, opt)
    for b, s in SHAPES:
        x = torch.randn(b, s, 32)
        out = compiled(x)
        with torch.no_grad():  # eager, with the weights this forward used
            eff = nmcompile.effective_weights(model)
            reference = functional_call(model, {**dict(model.named_parameters()), **eff}, x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    counts = {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"],
              "aot_compiles": counters["aot_autograd"]["total"], "graph_breaks": sum(counters["graph_break"].values())}
    return counts, out.detach(), reference


DYNAMIC = {
    "sr_ste": ("sr_ste:2:4", "aot_eager"),  # stateless
    "s_ste": ("s_ste:2:4", "aot_eager"),  # state: beta
    "mvue24": ("s_ste:2:4,wgrad=mvue24", "aot_eager"),  # token count padded to a multiple of 4
    "transposable": ("transposable:2:4,every=2", "aot_eager"),  # clocked, mask refreshed
    "mdgf": ("mdgf:2:4,decay_coef=0.3", "aot_eager"),  # clocked, alpha from the step
    "sr_ste_inductor": ("sr_ste:2:4", "inductor"),
}


@functools.lru_cache(maxsize=1)
def plain_aot_eager_counts():
    """The compile counts of plain aot_eager over SHAPES: the same for every case, so run once."""
    counts, _, _ = shapes_run(None, "aot_eager")
    return tuple(counts.items())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "inductor" in n else n for n in DYNAMIC])
def test_dynamic_shapes_compile_as_often_as_aot_eager(name):
    spec, inner = DYNAMIC[name]
    counts, out, reference = shapes_run(spec, "nmsparse", inner)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)  # the sparse weights are used
    want = dict(plain_aot_eager_counts())
    assert counts == want, f"nmsparse compiled {counts}, aot_eager {want}"
    assert counts["graphs"] == 2 and counts["graph_breaks"] == 0  # static, then dynamic


def test_sdgf_frame_change_in_a_dynamic_graph_is_a_clear_error():
    """Each SDGF frame is a static graph; a dynamic one (``dynamic=True``, or Dynamo's automatic
    dynamic after a shape change) cannot take the next frame's pattern: the first call in the new
    frame says what to do. (``dynamic=False`` compiles one graph per shape and frame.)
    """
    model, _, opt = build("sdgf:2:4,total_steps=4")  # 3:4 from step 0, 2:4 from step 2
    compiled = torch.compile(model, backend="nmsparse", options=AOT, dynamic=True)
    for b, s in SHAPES[:2]:
        compiled(torch.randn(b, s, 32)).sum().backward()
        opt.step()
    with pytest.raises(RuntimeError, match=r"'0.weight' was compiled with recipe sdgf.*\(frame 0\) but this "
                       r"call needs .*\(frame 1\) \(the graph has dynamic shapes\); compile with "
                       r"torch.compile\(\.\.\., dynamic=False\)"):
        compiled(torch.randn(*SHAPES[2], 32))
