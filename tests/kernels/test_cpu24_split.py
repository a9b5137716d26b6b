"""The 2:4 CPU kernel's work split: threads claim chunks of row groups as they finish, so a slow thread
(a busy core) takes fewer of them, and the result does not depend on who computed which rows.

A row's result depends only on its own tile, so 1 and 2 threads give bitwise equal outputs. The
slowed thread comes from ``nmsparse::cpu24_split_probe`` (the same product, one thread sleeping before
each chunk it claims, each thread's chunk count, the route and the pool calls left returned): a static half each would
count equal. Routes: 1 the OpenMP team, 2 the caller plus inter-op pool tasks (taken for a while after
an OpenMP call kept its caller waiting).
"""

import os
import subprocess
import sys

import pytest
import torch

from nmcompile import pack
from nmcompile.kernels import cpu24

pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")

BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def layout(out_f, in_f, dtype=torch.float32, seed=0):
    from nmcompile import masks

    w = masks.prune(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)), 2, 4, 1).to(dtype)
    p = pack(w)
    return cpu24.cpu_layout(p.values, p.meta)


def product(threads, x, values, bits, out_f, isa):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return torch.ops.nmsparse.cpu24_linear(x, values, bits, None, None, out_f, -1, isa)
    finally:
        torch.set_num_threads(before)


def probe(threads, x, values, bits, out_f, isa, slow_thread=-1, slow_us=0, route=-1):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return torch.ops.nmsparse.cpu24_split_probe(x, values, bits, out_f, isa, slow_thread, slow_us, route)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("route", [1, 2])
@pytest.mark.parametrize("slow_thread", [0, 1])
def test_a_slowed_thread_takes_few_chunks_and_the_result_is_unchanged(slow_thread, route):
    values, bits = layout(1024, 256)  # 128 groups of 8 rows: 64 chunks of 2 groups on 2 threads
    isa = cpu24.best_isa(torch.float32)
    x = torch.randn(1, 256)
    expected = product(1, x, values, bits, 1024, isa)
    quiet, counts, taken, _ = probe(2, x, values, bits, 1024, isa, route=route)
    if len(counts) != 2 or taken != route:
        pytest.skip(f"the split ran on {len(counts)} thread(s) by route {taken} for 2 by route {route} (a forked "
                    "child, or inside a parallel region)")
    assert torch.equal(quiet, expected) and int(counts.sum()) == 64
    # the slowed thread sleeps 5 ms before each chunk it claims; each chunk is microseconds of work
    out, counts, _, _ = probe(2, x, values, bits, 1024, isa, slow_thread, 5000, route)
    assert torch.equal(out, expected)
    fast = 1 - slow_thread
    assert int(counts.sum()) == 64 and counts[fast] >= 48, counts.tolist()  # a static split: 32 each


def test_an_openmp_team_that_keeps_the_caller_waiting_sends_the_next_calls_to_the_pool():
    # 64 chunks, each 4x a [2048, 2048] layer's: the worker starts before they run out, also with the
    # other core busy (at [2048, 2048] it did not, once, under `pytest -n 2`)
    values, bits = layout(4096, 4096)
    isa = cpu24.best_isa(torch.float32)
    x = torch.randn(1, 4096)
    # the OpenMP worker sleeps 5 ms before each chunk it claims: the caller waits for it (over 0.5 ms),
    # unless the caller itself lost its core for as long (shared cores): then the call is tried again
    for _ in range(20):  # a Zen 5 core ran all 64 chunks before the worker woke, 5 tries in a row, under -n 2
        _, counts, taken, left = probe(2, x, values, bits, 4096, isa, 1, 5000, route=1)
        if len(counts) != 2:
            pytest.skip(f"the split ran on {len(counts)} thread(s) for 2")
        assert taken == 1
        if left == 128:
            break
    assert left == 128, "no OpenMP call kept its caller waiting 0.5 ms in 20 tries"
    calls = [probe(2, x, values, bits, 4096, isa)[2:] for _ in range(130)]
    # 128 calls on the pool, each counting down, then the team is tried again
    assert calls[:128] == [(2, left) for left in range(127, -1, -1)] and calls[128][0] == 1, calls


def test_a_layer_too_small_to_split_stays_on_one_thread():
    values, bits = layout(56, 64)  # 7 groups: under the 8 a thread takes at least
    out, counts, taken, _ = probe(2, torch.randn(3, 64), values, bits, 56, cpu24.best_isa(torch.float32))
    assert counts.tolist() == [1] and taken == 0 and out.shape == (3, 56)


@pytest.mark.parametrize("out_f", [128, 136, 520, 4800])
@pytest.mark.parametrize("tokens", [1, 5])
def test_two_threads_equal_one_bitwise_for_any_chunking(out_f, tokens):
    # 16, 17, 65 and 600 groups: chunks of 1 to 9 groups, the last one shorter
    for dtype in cpu24.DTYPES:
        values, bits = layout(out_f, 64, dtype)
        x = torch.randn(tokens, 64).to(dtype)
        for isa in ("emulated512", cpu24.best_isa(dtype)):
            one = product(1, x, values, bits, out_f, isa)
            for route in (1, 2):
                assert torch.equal(probe(2, x, values, bits, out_f, isa, route=route)[0], one), (route, isa, dtype)


FORKED = """
import os, sys, torch
from nmcompile import masks, pack
from nmcompile.kernels import cpu24
w = masks.prune(torch.randn(1024, 256), 2, 4, 1)
p = pack(w)
values, bits = cpu24.cpu_layout(p.values, p.meta)
x = torch.randn(1, 256)
torch.set_num_threads(2)
isa = cpu24.best_isa(torch.float32)
out, counts, route, _ = torch.ops.nmsparse.cpu24_split_probe(x, values, bits, 1024, isa, -1, 0, 2)
pid = os.fork()
if pid == 0:  # the inter-op pool's threads are not copied: the caller computes alone, exactly
    child, child_counts, child_route, _ = torch.ops.nmsparse.cpu24_split_probe(x, values, bits, 1024, isa, -1, 0, 2)
    os._exit(0 if torch.equal(child, out) and child_route == 0 and child_counts.tolist() == [1] else 3)
_, status = os.waitpid(pid, 0)
print(len(counts), route, os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_after_the_pool_ran_computes_alone():
    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["2", "2", "0"], done.stdout + done.stderr[-2000:]


def test_results_stay_exact_with_a_busy_loop_pinned_to_one_core():
    core = max(os.sched_getaffinity(0))
    layers = [(layout(out_f, in_f, seed=i), out_f, in_f) for i, (out_f, in_f) in enumerate([(1024, 512), (600, 1040)])]
    isa = cpu24.best_isa(torch.float32)
    inputs = [(torch.randn(tokens, in_f), (values, bits), out_f) for (values, bits), out_f, in_f in layers
              for tokens in (1, 7)]
    expected = [product(1, x, v, b, out_f, isa) for x, (v, b), out_f in inputs]
    loop = subprocess.Popen([sys.executable, "-c", BUSY, str(core)])
    try:
        for _ in range(30):
            for (x, (v, b), out_f), want in zip(inputs, expected):
                assert torch.equal(product(2, x, v, b, out_f, isa), want)
                for route in (1, 2):
                    assert torch.equal(probe(2, x, v, b, out_f, isa, route=route)[0], want)
        assert loop.poll() is None, "the busy loop ended early"
    finally:
        loop.kill()
        loop.wait()
