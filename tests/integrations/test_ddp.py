"""DistributedDataParallel around a model compiled with the ``nmsparse`` backend (gloo, 2 CPU ranks), every recipe.

DDP wraps the compiled model (``DDP(torch.compile(m))``: ``torch.compile(DDP(m))`` never calls a
custom backend). Per recipe, on each rank: a run whose ``state_dict``s (model and optimizer, as rank 0 saves them) are
saved halfway while it goes on uninterrupted, and a fresh model that loads them and continues.
The checks are in ``_distributed.check``.
"""

from __future__ import annotations

import io

import pytest
import torch
from _distributed import RECIPES, STEPS, STOP, Net, check, per_rank, rank_loss, run_ranks, snapshot, train
from torch import nn

import nmcompile


def _compiled(net: Net, spec: str, rank: int | None = None):
    torch.manual_seed(100 + (rank or 0))  # ranks' generators differ: no state may depend on them
    nmcompile.annotate(net, spec, exclude=["head"])
    return torch.compile(net, backend="nmsparse", options={"inner": "aot_eager"})


def _setup(net: Net, spec: str, rank: int | None = None):
    model = _compiled(net, spec, rank)
    if rank is not None:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(net, opt)
    return model, opt


def _worker(rank: int, out_dir: str) -> None:
    results = {}
    for name, spec in RECIPES.items():
        torch._dynamo.reset()
        torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
        net = Net()
        initial = {k: v.detach().clone() for k, v in net.named_parameters()}
        model, opt = _setup(net, spec, rank)
        first = train(model, opt, range(STOP), rank_loss(rank))
        saved = io.BytesIO()
        torch.save({"model": net.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state()}, saved)
        saved.seek(0)
        losses = first + train(model, opt, range(STOP, STEPS), rank_loss(rank))  # the run goes on uninterrupted
        whole = snapshot(net)

        torch.manual_seed(7)
        net = Net()
        model, opt = _setup(net, spec, rank)
        state = torch.load(saved, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])  # MVUE draws from torch's generator
        rest = train(model, opt, range(STOP, STEPS), rank_loss(rank))
        results[name] = {
            "losses": losses, "whole": whole, "resumed": first + rest, "resumed_end": snapshot(net), "initial": initial,
        }
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_ddp_every_recipe_agrees_resumes_and_matches_one_process(tmp_path):
    run_ranks(_worker, str(tmp_path), timeout_s=600)
    r0, r1 = per_rank(tmp_path, "rank")
    # rank 1 started from other random weights; DDP broadcast rank 0's before the first step
    assert not all(torch.equal(r0["ste"]["initial"][k], r1["ste"]["initial"][k]) for k in r0["ste"]["initial"])
    check(r0, r1, _setup)  # one process starts from rank 0's weights (seed 0)
