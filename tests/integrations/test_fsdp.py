"""FSDP2 (``fully_shard``, gloo, 2 CPU ranks) with per-block ``compile(backend="nmsparse")``, every recipe.

Per recipe, on each rank: a run saved halfway with ``torch.distributed.checkpoint`` (and going on
uninterrupted), and a fresh sharded model that loads the checkpoint and resumes. The checks are in
``_distributed.check``: ranks agree on effective weights and all recipe state, N:M, bit-exact
resume, and the same training as one process on both ranks' batches.
"""

from __future__ import annotations

import pytest
import torch
from _distributed import (RECIPES, STEPS, STOP, Net, check, nm_ok, per_rank, rank_loss,
                          run_ranks, snapshot, train)

import nmcompile


def _setup(net: Net, spec: str, rank: int | None = None):
    if rank is not None:
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
    torch.manual_seed(100 + (rank or 0))  # ranks' generators differ: no state may depend on them
    nmcompile.annotate(net, spec, exclude=["head"])
    for block in net.blocks:
        block.compile(backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(net, opt)
    return net, opt


def _worker(rank: int, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    net = fully_shard(Net())
    with pytest.raises(ValueError, match="before fully_shard"):  # ASP's permutation would be lost
        nmcompile.annotate(net, "asp:2:4")
    # the route the error names: permute before fully_shard, attach the mask after it
    torch.manual_seed(0)
    net = Net()
    permuted = nmcompile.annotate(net, "asp:2:4", exclude=["head"]).prepared["asp:2:4"]
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    nmcompile.annotate(net, "asp:2:4,permute=False", exclude=["head"])
    for block in net.blocks:
        block.compile(backend="nmsparse", options={"inner": "aot_eager"})
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    nmcompile.hook_optimizer(net, opt)
    train(net, opt, range(2), rank_loss(rank))
    results = {"asp two-step": {"groups": len(permuted.groups), "whole": snapshot(net)}}
    for name, spec in RECIPES.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        net, opt = _setup(Net(), spec, rank)
        first = train(net, opt, range(STOP), rank_loss(rank))
        rng = torch.get_rng_state()  # MVUE draws from torch's generator: a checkpoint saves it
        model_sd, optim_sd = get_state_dict(net, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{out_dir}/{name}")
        losses = first + train(net, opt, range(STOP, STEPS), rank_loss(rank))  # the run goes on uninterrupted
        whole = snapshot(net)

        torch.manual_seed(7)  # other initial weights: the checkpoint must bring everything back
        net, opt = _setup(Net(), spec, rank)
        model_sd, optim_sd = get_state_dict(net, opt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=f"{out_dir}/{name}")
        set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        torch.set_rng_state(rng)
        rest = train(net, opt, range(STOP, STEPS), rank_loss(rank))
        results[name] = {"losses": losses, "whole": whole, "resumed": first + rest, "resumed_end": snapshot(net)}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_fsdp2_every_recipe_agrees_resumes_and_matches_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    run_ranks(_worker, str(tmp_path), timeout_s=600)
    r0, r1 = per_rank(tmp_path, "rank")
    two0, two1 = r0.pop("asp two-step"), r1.pop("asp two-step")
    assert two0["groups"] > 0  # the permutation ran before sharding
    assert len(two0["whole"]["effective"]) == 4
    for k, w in two0["whole"]["effective"].items():
        assert torch.equal(w, two1["whole"]["effective"][k]) and nm_ok(w, 2, 4), k
    check(r0, r1, _setup)
