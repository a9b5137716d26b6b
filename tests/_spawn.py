"""Run a function on two gloo ranks (CPU) and fail the test with the ranks' error or a timeout."""

from __future__ import annotations

import socket
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


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
