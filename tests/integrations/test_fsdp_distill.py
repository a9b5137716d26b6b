"""Distillation under FSDP2 (``fully_shard``, gloo, 2 CPU ranks): the pruned student (``asp:2:4,permute=False``,
its blocks compiled with ``backend="nmsparse"``) and the dense teacher sharded the same way, the logits' KL and
SquareHead's layer term on each rank's batch. The ranks agree, the mask is kept, and the run is the one process's
that averages the two ranks' losses (what averaging the ranks' gradients computes)."""

from __future__ import annotations

import copy

import pytest
import torch
from _distributed import Net, WORLD, batch, nm_ok, per_rank, run_ranks, snapshot

import nmcompile
from nmcompile.training.distill import Distillation

STEPS = 4


def _models(rank: int | None):
    """``(student, teacher, optimizer)``: the same dense weights on every rank, the student 2:4 by magnitude."""
    torch.manual_seed(0)
    teacher = Net()
    student = copy.deepcopy(teacher)
    if rank is not None:
        from torch.distributed.fsdp import fully_shard

        for net in (student, teacher):
            for block in net.blocks:
                fully_shard(block)
            fully_shard(net)
    nmcompile.annotate(student, "asp:2:4,permute=False", exclude=["head"])
    for block in student.blocks:
        block.compile(backend="nmsparse", options={"inner": "aot_eager"})
    return student, teacher, torch.optim.Adam(student.parameters(), lr=1e-2)


def _step(distill, student, optimizer, batches) -> float:
    """One optimizer step on the mean of the batches' distillation losses."""
    loss = sum(distill(student, x) for x in batches) / len(batches)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss)


def _worker(rank: int, out_dir: str) -> None:
    student, teacher, optimizer = _models(rank)
    with Distillation(student, teacher, layers=1.0) as distill:
        assert distill.blocks == ["blocks.0", "blocks.1"]
        losses = [_step(distill, student, optimizer, [batch(step, rank)[0]]) for step in range(STEPS)]
    torch.save({"losses": losses, "whole": snapshot(student)}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_fsdp2_distillation_agrees_keeps_the_mask_and_matches_one_process(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    run_ranks(_worker, str(tmp_path), timeout_s=600)
    r0, r1 = per_rank(tmp_path, "rank")
    assert r0["losses"] != r1["losses"]  # each rank its own batches
    for key in ("effective", "params", "state"):
        for k, v in r0["whole"][key].items():
            assert torch.equal(v, r1["whole"][key][k]), f"ranks differ on {k}"
    torch._dynamo.reset()
    student, teacher, optimizer = _models(None)
    masks = {k: v.clone() for k, v in r0["whole"]["state"].items()}
    with Distillation(student, teacher, layers=1.0) as distill:
        for step in range(STEPS):
            _step(distill, student, optimizer, [batch(step, r)[0] for r in range(WORLD)])
    one = snapshot(student)
    dense = teacher.state_dict()
    assert all(not torch.equal(one["params"][k], dense[k]) for k in one["params"] if k.startswith("blocks."))  # trained
    for k, v in one["params"].items():
        torch.testing.assert_close(r0["whole"]["params"][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    for k, w in r0["whole"]["effective"].items():
        assert nm_ok(w, 2, 4), k
        mask = masks[k.replace(".weight", ".weight_nm_mask")]
        assert not bool(((w != 0) & (mask == 0)).any()), k  # nothing grew outside the mask
    assert one["state"].keys() == masks.keys() and all(torch.equal(one["state"][k], m) for k, m in masks.items())
