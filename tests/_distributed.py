"""What the multi-process tests share: two gloo ranks (CPU), a small two-block model, every recipe
with a schedule short enough to change inside the run, and the checks every engine must pass."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import nmcompile

WORLD = 2
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


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(net, opt, steps, loss_of) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(net, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def rank_loss(rank):
    def loss_of(net, step):
        x, y = batch(step, rank)
        return F.mse_loss(net(x), y)

    return loss_of


def nm_ok(w: torch.Tensor, n: int, m: int) -> bool:
    return bool(((w.reshape(w.shape[0], -1, m) != 0).sum(-1) <= n).all())




def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, port: int, args) -> None:
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, *args, timeout_s: float = 300) -> None:
    """``fn(rank, *args)`` in ``WORLD`` processes with a gloo process group initialised."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.spawn(_entry, args=(fn, _free_port(), args), nprocs=WORLD, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):  # raises if a rank failed
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
            pytest.fail(f"ranks did not finish within {timeout_s} s")


def per_rank(directory, stem: str) -> list:
    """What each rank saved as ``<directory>/<stem><rank>.pt``, in rank order."""
    return [torch.load(f"{directory}/{stem}{rank}.pt", weights_only=False) for rank in range(WORLD)]


def snapshot(net) -> dict:
    """Effective weights (whole), recipe state and whole parameters of ``net``, as plain tensors."""
    from nmcompile.state.sharding import full

    sd = net.state_dict()
    return {
        "effective": nmcompile.effective_weights(net),
        "state": {k: v.clone() for k, v in sd.items() if "_nm_" in k},
        "params": {k: full(v).detach().clone() for k, v in sd.items() if "_nm_" not in k},
    }


def reference(spec: str, setup) -> dict:
    """One process, both ranks' batches in one: the loss whose gradient the ranks' averaged gradient is.

    One forward, not one per rank: the SR-STE term joins the gradient once per backward pass.
    ``setup(net, spec)`` annotates, compiles and returns ``(model to call, optimizer)``.
    """

    def loss_of(model, step):
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        return F.mse_loss(model(torch.cat(xs)), torch.cat(ys))

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    model, opt = setup(net, spec)
    train(model, opt, range(STEPS), loss_of)
    return snapshot(net)


def check(r0: dict, r1: dict, setup) -> None:
    """Per recipe: ranks agree on weights and all recipe state, effective weights are N:M, the resumed
    run is bit-for-bit the uninterrupted one, and training matches one process (deterministic recipes)."""
    for name, spec in RECIPES.items():
        a, b = r0[name], r1[name]
        recipe = nmcompile.recipe(spec)
        assert a["losses"] != b["losses"], f"{name}: ranks saw the same data"
        for key in ("effective", "state", "params"):
            assert a["whole"][key].keys() == b["whole"][key].keys(), (name, key)
            for k in a["whole"][key]:
                assert torch.equal(a["whole"][key][k], b["whole"][key][k]), f"{name}: ranks differ on {k}"
        assert len(a["whole"]["effective"]) == 4, name
        final_n = 1 if name == "sdgf" else recipe.n  # sdgf ends on its target pattern
        for k, w in a["whole"]["effective"].items():
            assert nm_ok(w, final_n, recipe.m), f"{name}: {k} is not {final_n}:{recipe.m}"
        assert a["resumed"] == a["losses"], f"{name}: resumed losses differ"
        for key in ("effective", "state", "params"):
            for k, v in a["whole"][key].items():
                assert torch.equal(a["resumed_end"][key][k], v), f"{name}: resumed {k} differs"
    # the schedules really ran: STEP switched
    assert all(bool(v) for k, v in r0["step"]["whole"]["state"].items() if k.endswith("_nm_phase"))
    for name, spec in RECIPES.items():
        if name in STOCHASTIC:
            continue
        ref, got = reference(spec, setup), r0[name]["whole"]
        for key in ("params", "state"):
            for k, v in ref[key].items():
                torch.testing.assert_close(got[key][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")
