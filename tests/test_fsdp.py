"""FSDP2 (``fully_shard``, gloo, 2 CPU ranks) with per-block ``compile(backend="nmsparse")``, every recipe.

Per recipe, on each rank: an uninterrupted run, and a run stopped halfway, saved with
``torch.distributed.checkpoint`` into a fresh sharded model and resumed. The test checks that the
ranks agree on the effective weights and on all recipe state, that the effective weights are N:M,
that the resumed run is bit-for-bit the uninterrupted one, and that the sharded training computes
what one process computes from both ranks' batches (the gradient FSDP2 averages).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _spawn import WORLD, run_ranks
from torch import nn

import nmcompile

STEPS, STOP = 6, 3
RECIPES = {  # schedules short enough that each changes inside the run
    "ste": "ste:2:4",
    "sr_ste": "sr_ste:2:4",
    "s_ste": "s_ste:2:4",
    "s_ste+mvue24": "s_ste:2:4,wgrad=mvue24",
    "step": "step:2:4,total_steps=8,t_min=0.25,t_max=0.5",  # switches at step 4 at the latest
    "mdgf": "mdgf:2:4,decay_coef=0.5,finetune_fraction=0.34,total_steps=6",  # binary from step 4
    "sdgf": "sdgf:1:8,total_steps=6",  # a new N:M frame every 2 steps
    "bi_mask": "bi_mask:2:4,every=2,candidates=8",
    "transposable": "transposable:2:4,every=2",
    "asp": "asp:2:4,permute=False",
}
STOCHASTIC = {"s_ste+mvue24"}  # random gradient estimator: ranks draw differently from one process


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _setup(net: Net, spec: str, rank: int | None):
    if rank is not None:
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        torch.manual_seed(100 + rank)  # ranks draw differently: random state must come from rank 0
    else:
        torch.manual_seed(100)
    nmcompile.annotate(net, spec, exclude=["head"])
    for block in net.blocks:
        block.compile(backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(net, opt)
    return opt


def _train(net, opt, steps, loss_of) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(net, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _snapshot(net) -> dict:
    from nmcompile.sharding import full

    sd = net.state_dict()
    return {
        "effective": nmcompile.effective_weights(net),  # gathered on every rank
        "state": {k: v.clone() for k, v in sd.items() if "_nm_" in k},
        "params": {k: full(v).detach().clone() for k, v in sd.items() if "_nm_" not in k},
    }


def _rank_loss(rank):
    def loss_of(net, step):
        x, y = _batch(step, rank)
        return F.mse_loss(net(x), y)

    return loss_of


def _worker(rank: int, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net = Net()
    from torch.distributed.fsdp import fully_shard

    fully_shard(net)
    with pytest.raises(ValueError, match="before fully_shard"):  # ASP's permutation would be lost
        nmcompile.annotate(net, "asp:2:4")
    results = {}
    for name, spec in RECIPES.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = Net()
        opt = _setup(net, spec, rank)
        losses = _train(net, opt, range(STEPS), _rank_loss(rank))
        whole = _snapshot(net)

        torch.manual_seed(0)
        net = Net()
        opt = _setup(net, spec, rank)
        first = _train(net, opt, range(STOP), _rank_loss(rank))
        rng = torch.get_rng_state()  # MVUE draws from torch's generator: a checkpoint saves it
        model_sd, optim_sd = get_state_dict(net, opt)
        path = f"{out_dir}/{name}"
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

        torch.manual_seed(7)  # other initial weights: the checkpoint must bring everything back
        net = Net()
        opt = _setup(net, spec, rank)
        model_sd, optim_sd = get_state_dict(net, opt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=path)
        set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        torch.set_rng_state(rng)
        rest = _train(net, opt, range(STOP, STEPS), _rank_loss(rank))
        results[name] = {"losses": losses, "whole": whole, "resumed": first + rest, "resumed_end": _snapshot(net)}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _reference(spec: str) -> dict:
    """One process, both ranks' batches in one: the loss whose gradient FSDP2's averaged gradient is.

    One forward, not one per rank: the SR-STE term joins the gradient once per backward pass.
    """

    def loss_of(net, step):
        xs, ys = zip(*(_batch(step, r) for r in range(WORLD)))
        return F.mse_loss(net(torch.cat(xs)), torch.cat(ys))

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    opt = _setup(net, spec, None)
    _train(net, opt, range(STEPS), loss_of)
    return _snapshot(net)


def _nm_ok(w: torch.Tensor, n: int, m: int) -> bool:
    return bool(((w.reshape(w.shape[0], -1, m) != 0).sum(-1) <= n).all())


@pytest.mark.slow
def test_fsdp2_every_recipe_agrees_resumes_and_matches_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    run_ranks(_worker, str(tmp_path), timeout_s=600)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    for name, spec in RECIPES.items():
        a, b = r0[name], r1[name]
        recipe = nmcompile.recipe(spec)
        assert a["losses"] != b["losses"], f"{name}: ranks saw the same data"
        # ranks agree on weights and on every piece of recipe state (masks, beta, perms, clocks, v)
        for key in ("effective", "state", "params"):
            assert a["whole"][key].keys() == b["whole"][key].keys(), (name, key)
            for k in a["whole"][key]:
                assert torch.equal(a["whole"][key][k], b["whole"][key][k]), f"{name}: ranks differ on {k}"
        assert len(a["whole"]["effective"]) == 4, name
        final_n = 1 if name == "sdgf" else recipe.n  # sdgf ends on its target pattern
        for k, w in a["whole"]["effective"].items():
            assert _nm_ok(w, final_n, recipe.m), f"{name}: {k} is not {final_n}:{recipe.m}"
        # exact resume from torch.distributed.checkpoint
        assert a["resumed"] == a["losses"], f"{name}: resumed losses differ"
        for key in ("effective", "state", "params"):
            for k, v in a["whole"][key].items():
                assert torch.equal(a["resumed_end"][key][k], v), f"{name}: resumed {k} differs"
    # schedules really ran: STEP switched, SDGF reached its last frame
    assert all(bool(v) for k, v in r0["step"]["whole"]["state"].items() if k.endswith("_nm_phase"))
    for name, spec in RECIPES.items():
        if name in STOCHASTIC:
            continue
        ref, got = _reference(spec), r0[name]["whole"]
        for k, v in ref["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")
        for k, v in ref["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")
