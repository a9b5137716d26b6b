"""DistributedDataParallel around a model compiled with the ``nmsparse`` backend (gloo, 2 CPU ranks)."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2
STEPS = 3
RECIPE = "sr_ste:2:4"
NM_WEIGHTS = ("fc1.weight", "fc2.weight", "head.weight")
TIMEOUT_S = 180


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees different data
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _worker(rank: int, port: int, out_dir: str) -> None:
    import nmcompile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
        model = MLP()
        compiled = torch.compile(model, backend="nmsparse", options={"recipe": RECIPE, "inner": "aot_eager"})
        ddp = nn.parallel.DistributedDataParallel(compiled)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        x, y = _batch(rank)
        losses = []
        for _ in range(STEPS):
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in model.named_parameters()},
                "initial": initial,
                "effective": nmcompile.effective_weights(model),
                "check_ok": nmcompile.check(model).ok,
                "check_names": sorted(nmcompile.check(model)),
                "losses": losses,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def _nm_violations(w: torch.Tensor, dim: int = 1, n: int = 2, m: int = 4) -> int:
    g = w.movedim(dim, -1)
    nonzero = (g.reshape(*g.shape[:-1], -1, m) != 0).sum(-1)
    return int((nonzero > n).sum())


@pytest.mark.slow
def test_ddp_gloo_two_ranks(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):  # raises if a rank failed
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
            pytest.fail(f"DDP ranks did not finish within {TIMEOUT_S} s")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    r0, r1 = results

    # the ranks trained on different data, yet hold bit-identical parameters
    assert r0["losses"] != r1["losses"]
    assert set(r0["params"]) == set(r1["params"])
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
        assert not torch.equal(r0["params"][name], r0["initial"][name]), f"{name} did not train"
    # DDP broadcast rank 0's initial weights (rank 1 started from other random weights)
    assert all(torch.equal(r0["initial"][k], r1["initial"][k]) for k in r0["initial"])

    for res in results:
        assert all(torch.isfinite(torch.tensor(res["losses"])))
        assert res["check_ok"]
        assert res["check_names"] == sorted(NM_WEIGHTS)
        assert sorted(res["effective"]) == sorted(NM_WEIGHTS)
        for name, w in res["effective"].items():
            assert _nm_violations(w) == 0, name
            assert (w == 0).float().mean() >= 0.5, name
    for name in NM_WEIGHTS:
        assert torch.equal(r0["effective"][name], r1["effective"][name]), name
