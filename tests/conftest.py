import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    """Each test starts with an empty Dynamo cache and no NMSPARSE_RECIPE from the environment."""
    monkeypatch.delenv("NMSPARSE_RECIPE", raising=False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
