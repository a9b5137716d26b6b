import importlib
import os
import sys
from pathlib import Path

# Inductor compiles in this process (and in the processes tests start, which inherit it) instead of a
# pool of compile workers: on the 2-core machines the suite runs on, the pool's processes only compete
# with the other test worker (tests/masks/test_masks.py with a cold Inductor cache: 136 -> 130 s wall,
# 127 -> 118 s user CPU). Set it to another value to override.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The nmsparse backend's graphs are compiled with aot_eager where a test names no inner compiler: the
# passes, the recipes' ops and their autograd run the same, without Inductor's code generation (a third of
# the suite's time). Tests of what Inductor does with the graphs carry @pytest.mark.inductor or name
# inner="inductor" (every recipe's numerics run under both). Processes the tests start inherit it.
os.environ.setdefault("NMSPARSE_INNER", "aot_eager")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo(request, monkeypatch, tmp_path_factory):
    """Each test starts with an empty Dynamo cache, no NMSPARSE_RECIPE from the environment and its own
    empty decision cache (never the user's: tests time with fake timers); a test marked ``inductor``
    without NMSPARSE_INNER (the backend's own default)."""
    monkeypatch.delenv("NMSPARSE_RECIPE", raising=False)
    if request.node.get_closest_marker("inductor"):
        monkeypatch.delenv("NMSPARSE_INNER", raising=False)
    monkeypatch.delenv("NMCOMPILE_DECISION_CACHE", raising=False)
    monkeypatch.setenv("NMCOMPILE_CACHE_DIR", str(tmp_path_factory.mktemp("nmcompile-cache")))
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def benchmark_script():
    """Imports a script of ``benchmarks/`` by name: ``benchmark_script("real_scale")`` is
    ``benchmarks/models/real_scale.py`` (its path: the module's ``__file__``). The repository root goes on
    ``sys.path`` after the installed packages, for the session: the scripts import the toolbox and each
    other as ``benchmarks.<group>.<script>``."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))

    def load(name: str):
        found = sorted(BENCHMARKS.glob(f"*/{name}.py"))
        if len(found) != 1:
            raise LookupError(f"benchmark script {name!r}: {len(found)} files benchmarks/*/{name}.py")
        return importlib.import_module(f"benchmarks.{found[0].parent.name}.{name}")

    return load
