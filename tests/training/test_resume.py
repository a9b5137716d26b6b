"""Exact resume: a run stopped after step k and resumed from state dicts continues bit for bit.

For every recipe, an uninterrupted run of ``T`` optimizer steps records each step's loss (as a
Python float), effective weights and state dict, and saves a checkpoint after ``k`` steps for
several stop points ``k``, chosen right before and right after each recipe's transition (STEP's
AutoSwitch, an SDGF frame change, MDGF's decay into its binary fine-tuning, a Bi-Mask permutation
refresh, a transposable mask refresh). Each checkpoint goes through ``torch.save`` and is resumed:

- into a *fresh* model (another init seed, annotated and compiled again, a new optimizer and
  hook), with Dynamo's cache warm (one compiled graph serves every instance) and, for the last
  stop point of recipes with a schedule or random draws, cold (``torch._dynamo.reset()``, as in a
  new process: the first compile then happens at step k, e.g. in a later SDGF frame);
- into the *same* objects that finished the run (model, compiled model, optimizer, hook): a
  rewind, where every Python-side copy of the state (step mirrors, the hook's per-weight records,
  the backend's frame choice) must follow the loaded tensors. A model mixing STEP, SDGF and
  Bi-Mask is rewound to every step 1..T-1.

Each must reproduce the rest of the run with ``torch.equal`` and ``==``: losses, effective weights
after every step, and at the end the whole state dicts of model and optimizer. One case runs
through Inductor instead of ``aot_eager``.

A checkpoint holds ``model.state_dict()``, ``optimizer.state_dict()`` and ``torch.get_rng_state()``:
MVUE's gradient estimator and Bi-Mask's permutation search draw from torch's global generator, so,
as with dropout, a resumed run repeats those draws only if the user restores the generator too.
The data of step ``i`` comes from its own seeded generator, so every run sees the same batches.

Every transition is asserted to happen inside the run, where the stop points expect it, so a
schedule that stopped firing (or fired at another step) fails here.
"""

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nmcompile
from nmcompile import recipes
from nmcompile.declare.annotate import annotation_of

T = 12  # optimizer steps of every run
LR = 1e-2


def net(seed):
    torch.manual_seed(seed)
    # every reduction and output dimension divisible by 8: 1:8 and the two-axis recipes fit
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def build(case, seed, inner):
    model = net(seed)
    nmcompile.annotate(model, case.spec)
    compiled = torch.compile(model, backend="nmsparse", options={"inner": inner})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, **case.adam)
    hook = nmcompile.hook_optimizer(model, opt)
    return model, compiled, opt, hook


def train_step(compiled, opt, step):
    x, y = batch(step)
    loss = F.mse_loss(compiled(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()  # a float32 value, exactly


def effective(model):
    return {name: w.detach().clone() for name, w in nmcompile.effective_weights(model).items()}


def checkpoint(model, opt) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}, buffer)
    return buffer.getvalue()


def restore(model, opt, ckpt: bytes) -> None:
    saved = torch.load(io.BytesIO(ckpt), weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    torch.set_rng_state(saved["rng"])


def uninterrupted(case, inner):
    """Losses, effective weights and state dicts after each step, a checkpoint after each stop."""
    built = build(case, 0, inner)
    model, compiled, opt, _ = built
    run = {"loss": [], "eff": [], "state": [], "ckpt": {}, "built": built}
    for step in range(T):
        run["loss"].append(train_step(compiled, opt, step))
        run["eff"].append(effective(model))
        run["state"].append({k: v.clone() for k, v in model.state_dict().items()})
        if step + 1 in case.stops:
            run["ckpt"][step + 1] = checkpoint(model, opt)
    run["opt"] = checkpoint(model, opt)
    return run


def assert_equal_dicts(got, want, what):
    assert got.keys() == want.keys(), what
    for key in want:
        assert torch.equal(got[key], want[key]), f"{what}: {key} differs"


def continue_and_compare(run, built, k, how):
    model, compiled, opt, _ = built
    assert_equal_dicts(effective(model), run["eff"][k - 1], f"effective weights right after loading ({how} after {k})")
    for step in range(k, T):
        loss = train_step(compiled, opt, step)
        assert loss == run["loss"][step], f"loss of step {step} ({how} after {k}): {loss!r} != {run['loss'][step]!r}"
        assert_equal_dicts(effective(model), run["eff"][step], f"effective weights after step {step} ({how} after {k})")
    assert_equal_dicts(model.state_dict(), run["state"][-1], f"final model state dict ({how} after {k})")
    final = torch.load(io.BytesIO(checkpoint(model, opt)), weights_only=True)["opt"]
    want = torch.load(io.BytesIO(run["opt"]), weights_only=True)["opt"]
    assert final["param_groups"] == want["param_groups"]
    for index, state in want["state"].items():
        assert_equal_dicts(final["state"][index], state, f"optimizer state of parameter {index} ({how} after {k})")


def resume_fresh(case, run, k, inner):
    built = build(case, 1, inner)  # another init: everything must come from the checkpoint
    restore(built[0], built[2], run["ckpt"][k])
    continue_and_compare(run, built, k, "fresh resume")


def rewind(run, k):
    built = run["built"]  # the model, optimizer and hook that have just run all T steps
    restore(built[0], built[2], run["ckpt"][k])
    continue_and_compare(run, built, k, "rewind")


# ---- transitions, asserted on the uninterrupted run ----


def nonzero_fraction(run, step, name):
    w = run["eff"][step][name]
    return (w != 0).sum().item() / w.numel()


def no_transition(run, layer):
    pass


# AutoSwitch on Z_t: the optimizer's eps sits just above the mean of the Z_t window at step 5 and
# just below it at step 4 (t_min = 3, t_max = 9), so whether a run resumed after step 3 switches at
# step 4 depends on the restored window of Z_t samples
STEP_SWITCH = 5


def step_switched(at, by_z=False):
    def check(run, layer):
        if by_z:
            assert at < CASES["step"].recipe.switch_range[1], "the switch should come from Z_t, before t_max"
        phases = [bool(s[f"{layer}_nm_phase"]) for s in run["state"]]  # after each step
        assert phases == [False] * (at - 1) + [True] * (T - at + 1), f"phase after each step: {phases}"
        assert int(run["state"][-1][f"{layer}_nm_switch_step"]) == at
        assert nonzero_fraction(run, at - 2, layer) == 1 and nonzero_fraction(run, at - 1, layer) == 0.5

    return check


MDGF_FINETUNE = 8  # total_steps - int(finetune_fraction * total_steps)


def mdgf_decayed(run, layer):
    recipe = CASES["mdgf"].recipe
    assert recipe.finetune_start == MDGF_FINETUNE
    alphas = [float(recipe.alpha(torch.tensor(i + 1))) for i in range(T)]  # forward after step i + 1
    assert all(a > b > 0 for a, b in zip(alphas[: MDGF_FINETUNE - 2], alphas[1 : MDGF_FINETUNE - 1]))
    assert alphas[MDGF_FINETUNE - 1 :] == [0.0] * (T - MDGF_FINETUNE + 1)
    assert nonzero_fraction(run, MDGF_FINETUNE - 2, layer) == 1
    assert nonzero_fraction(run, MDGF_FINETUNE - 1, layer) == 0.5


def sdgf_frames(run, layer):
    # 1:8 stepwise over 12 steps: 7:8 from step 0, 4:8 from 3, 2:8 from 6, 1:8 from 9
    assert CASES["sdgf_1of8"].recipe.frame_starts == (0, 3, 6, 9)
    fractions = [nonzero_fraction(run, i, layer) for i in range(T)]  # forward after step i + 1
    assert fractions == [7 / 8] * 2 + [4 / 8] * 3 + [2 / 8] * 3 + [1 / 8] * 4


def refreshed(key):
    def check(run, layer):
        values = [s[f"{layer}_nm_{key}"] for s in run["state"]]
        changed = [i + 1 for i in range(1, T) if not torch.equal(values[i], values[i - 1])]
        assert 3 in changed and set(changed) <= {3, 6, 9, 12}, f"{key} changed after steps {changed}"

    return check


class Case:
    def __init__(self, spec, stops, transition=no_transition, cold=True, **adam):
        self.spec, self.stops, self.transition, self.cold, self.adam = spec, stops, transition, cold, adam
        self.recipe = recipes.parse(spec) if isinstance(spec, str) else None


CASES = {
    # cold=False: no schedule and no random draw, for which a compile after loading could matter
    "ste": Case("ste:2:4", (1, 7), cold=False),
    "sr_ste_4of8": Case("sr_ste:4:8,decay=0.05", (1, 7), cold=False),
    "s_ste": Case("s_ste:2:4", (1, 7), cold=False),
    "s_ste_mvue24": Case("s_ste:2:4,wgrad=mvue24", (1, 6)),
    "s_ste_full": Case("s_ste:2:4,wgrad=mvue24,fp8=true", (4,)),  # the paper's recipe, FP8 simulated
    "step": Case(
        "step:2:4,total_steps=12,t_min=0.25,t_max=0.75,beta2=0.9,decay=0.05",
        (STEP_SWITCH - 2, STEP_SWITCH - 1, STEP_SWITCH, STEP_SWITCH + 1),
        step_switched(STEP_SWITCH, by_z=True),
        betas=(0.9, 0.9),
        eps=5.365e-6,
    ),
    "mdgf": Case(
        "mdgf:2:4,decay_coef=0.3,finetune_fraction=0.34,total_steps=12",
        (3, MDGF_FINETUNE - 1, MDGF_FINETUNE),
        mdgf_decayed,
    ),
    "sdgf_1of8": Case("sdgf:1:8,total_steps=12", (2, 3, 4, 9), sdgf_frames),
    "bi_mask": Case("bi_mask:2:4,every=3,candidates=8", (2, 3, 4, 6), refreshed("perm")),
    "transposable": Case("transposable:2:4,every=3", (2, 3, 4, 6), refreshed("mask")),
    "asp": Case("asp:2:4", (1, 7), cold=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_run_continues_bit_for_bit(name):
    case = CASES[name]
    run = uninterrupted(case, "aot_eager")
    case.transition(run, "2.weight")
    rewind(run, case.stops[0])
    for k in case.stops[:-1]:
        resume_fresh(case, run, k, "aot_eager")
    if case.cold:
        torch._dynamo.reset()  # as in a new process: the first compile happens at the last stop point
    resume_fresh(case, run, case.stops[-1], "aot_eager")


@pytest.mark.inductor
@pytest.mark.slow
def test_resumed_run_continues_bit_for_bit_under_inductor():
    case = Case("s_ste:2:4,wgrad=mvue24", (5,))
    run = uninterrupted(case, "inductor")
    resume_fresh(case, run, 5, "inductor")  # warm: a second Inductor compile would double the time


def test_every_stop_point_of_a_model_mixing_schedules():
    """Rewound to every k in 1..T-1 (and resumed fresh at one): STEP, SDGF and Bi-Mask side by side."""
    rules = {
        "0.weight": "step:2:4,total_steps=12,t_min=0.25,t_max=0.5",  # switches at t_max: after step 6
        "2.weight": "sdgf:1:8,total_steps=12",
        "4.weight": "bi_mask:2:4,every=3,candidates=8",
    }
    case = Case(rules, tuple(range(1, T)))
    run = uninterrupted(case, "aot_eager")
    step_switched(6)(run, "0.weight")
    sdgf_frames(run, "2.weight")
    refreshed("perm")(run, "4.weight")
    for k in case.stops:
        rewind(run, k)
    resume_fresh(case, run, 6, "aot_eager")


def test_annotations_survive_loading_with_assign():
    model = net(1)
    nmcompile.annotate(model, "transposable:2:4,every=3")
    saved = net(0)
    nmcompile.annotate(saved, "transposable:2:4,every=3")
    model.load_state_dict(saved.state_dict(), assign=True)
    assert_equal_dicts(effective(model), effective(saved), "effective weights after load_state_dict(assign=True)")


@pytest.mark.parametrize("route", ["deepcopy", "pickle then deepcopy"])
def test_a_copied_model_keeps_its_recipes_and_trains_on_its_own(route):
    """copy.deepcopy (an EMA or teacher model) keeps each weight's recipe and state; the copy then
    continues exactly like the original, and training one leaves the other untouched."""
    case = Case("step:2:4,total_steps=12,t_min=0,t_max=0.25", (), None)
    model, compiled, opt, _ = build(case, 0, "aot_eager")
    for step in range(4):  # past the switch at step 3
        train_step(compiled, opt, step)
    if route == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = copy.deepcopy(torch.load(buf, weights_only=False))
    for name, _ in model.named_parameters():
        mname, _, pname = name.rpartition(".")
        ann, twin_ann = annotation_of(model.get_submodule(mname), pname), annotation_of(twin.get_submodule(mname), pname)
        assert (twin_ann is None) == (ann is None), name
        assert ann is None or (twin_ann == ann and twin_ann is not ann), name
    assert bool(twin[0].weight_nm_phase) and int(twin[0].weight_nm_switch_step) == 3
    assert_equal_dicts(effective(twin), effective(model), "effective weights of the copy")

    twin_opt = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=0.01)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its step tensors would be shared
    nmcompile.hook_optimizer(twin, twin_opt)
    twin_compiled = torch.compile(twin, backend="nmsparse", options={"inner": "aot_eager"})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(4, 7):
        assert train_step(twin_compiled, twin_opt, step) == train_step(compiled, opt, step)
    assert_equal_dicts(twin.state_dict(), model.state_dict(), "state after training both")
    for step in range(7, 9):
        train_step(twin_compiled, twin_opt, step)
    assert int(model[0].weight_nm_step) == 7 and int(twin[0].weight_nm_step) == 9
    assert not torch.equal(model[0].weight, twin[0].weight)
    model.load_state_dict(twin.state_dict())  # the original's own load hooks still work
    assert_equal_dicts(model.state_dict(), twin.state_dict(), "original after loading the copy")
    assert not torch.equal(model[0].weight, before["0.weight"])


def test_reannotating_a_replaced_parameter_leaves_no_stale_state_or_hooks():
    model = net(0)
    nmcompile.annotate(model, "s_ste:2:4")
    model[0].weight = nn.Parameter(torch.randn(64, 32))  # a new parameter object: the module keeps the record
    assert annotation_of(model[0], "weight").recipe == recipes.parse("s_ste:2:4")
    nmcompile.annotate(model, "sr_ste:2:4")  # another recipe, without state
    assert not any("_nm_" in key for key in model[0].state_dict())  # s_ste's beta is gone
    assert len(model[0]._load_state_dict_pre_hooks) == len(model[0]._state_dict_pre_hooks) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(model.state_dict())
    assert not [w for w in caught if "nmcompile" in str(w.message)]
    assert annotation_of(model[0], "weight").recipe == recipes.parse("sr_ste:2:4")


def test_resumed_framed_recipe_compiles_for_its_current_frame():
    """A run resumed in a later SDGF frame compiles that frame first: with dynamic shapes, where a
    graph cannot change frames, it works instead of asking for dynamic=False."""
    saved = net(0)
    nmcompile.annotate(saved, "sdgf:1:8,total_steps=12")
    with torch.no_grad():
        for name, buffer in saved.named_buffers():
            if name.endswith("_nm_step"):
                buffer.fill_(7)  # frame 2 of 7:8, 4:8, 2:8, 1:8 (starts 0, 3, 6, 9)
    model = net(1)
    nmcompile.annotate(model, "sdgf:1:8,total_steps=12")
    model.load_state_dict(saved.state_dict())
    compiled = torch.compile(model, backend="nmsparse", options={"inner": "aot_eager"}, dynamic=True)
    x = torch.randn(5, 32)
    out = compiled(x)
    weights = effective(model)
    assert all(int((w.reshape(w.shape[0], -1, 8) != 0).sum(-1).max()) == 2 for w in weights.values())  # 2:8
    want = x
    for i, layer in enumerate(model):
        want = F.linear(want, weights[f"{i}.weight"], layer.bias) if isinstance(layer, nn.Linear) else layer(want)
    torch.testing.assert_close(out, want)
