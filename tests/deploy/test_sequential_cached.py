"""Sequential one-shot on cached block inputs (nmcompile.oneshot.sequential): the same weights as
re-running the model before each block, blocks taken in the order they run, a model whose blocks do
not chain falls back (and says so), and an error names the blocks already written."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.oneshot import sequential
from nmcompile.oneshot.solve import half_written
from nmcompile.state import memory

import reference as ref
from models import AOT

pytestmark = pytest.mark.filterwarnings("ignore:nmsparse. recipe state for")


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.register_buffer("poison", torch.zeros(()))

    def forward(self, x, scale=None, *, mask=None):
        h = torch.tanh(self.fc1(x + self.poison))
        if mask is not None:
            h = h * mask
        return (x + scale * self.fc2(h),)  # a tuple, as Hugging Face blocks once returned


class Chained(nn.Module):
    """Embedding, then blocks that run in ``order`` (not registration order), with a positional and a
    keyword argument computed once per forward."""

    def __init__(self, depth=3, width=16, order=None):
        super().__init__()
        self.emb = nn.Embedding(50, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.order = order or list(range(depth))

    def forward(self, ids):
        x = self.emb(ids)
        scale = torch.full((), 0.5)
        mask = (torch.arange(x.shape[-1] * 2) % 3 != 0).float()
        for k in self.order:
            x = self.layers[k](x, scale, mask=mask)[0]
        return x


def batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (4, 10), generator=g) for _ in range(n)]


def reference(model, data, recipe):
    """Each block solved in the order it runs, on the outputs of the blocks already pruned (plain
    equations, eager): what SparseGPT's sequential form computes."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        x = torch.cat([model.emb(b) for b in data])
        scale, mask = torch.full((), 0.5), (torch.arange(x.shape[-1] * 2) % 3 != 0).float()
        for k in model.order:
            block = model.layers[k]
            a = x.reshape(-1, x.shape[-1])
            h = torch.tanh(block.fc1(x)) * mask
            solve = ref.sparsegpt if recipe.startswith("sparsegpt") else ref.wanda
            w1 = solve(block.fc1.weight, a, 2, 4)
            w2 = solve(block.fc2.weight, h.reshape(-1, h.shape[-1]), 2, 4)
            block.fc1.weight.copy_(w1[0] if isinstance(w1, tuple) else w1)
            block.fc2.weight.copy_(w2[0] if isinstance(w2, tuple) else w2)
            x = block(x, scale, mask=mask)[0]
    return model


@pytest.mark.parametrize("recipe", ["sparsegpt:2:4,blocksize=8", "wanda:2:4"])
def test_cached_blocks_give_the_sequential_weights_in_the_order_the_blocks_run(recipe):
    torch.manual_seed(0)
    model = Chained(order=[2, 0, 1]).eval()
    want = reference(model, batches(), recipe)
    nmcompile.annotate(model, recipe)
    done = []
    report = nmcompile.finalize(model, calibration=batches(), sequential=True, calibration_options=AOT,
                                progress=lambda k, total, note: done.append((k, total, note.split()[0])))
    assert "each block ran alone on its cached inputs" in report.calibration
    assert done == [(0, 3, "inputs"), (1, 3, "layers.2"), (2, 3, "layers.0"), (3, 3, "layers.1")]
    for (name, got), theirs in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(got, theirs, rtol=1e-4, atol=1e-4, msg=name)
    assert nmcompile.check(model).ok


def test_cached_blocks_match_rerunning_the_model_before_each_block():
    torch.manual_seed(1)
    cached = Chained().eval()
    rerun = copy.deepcopy(cached)
    for model in (cached, rerun):
        nmcompile.annotate(model, "sparsegpt:2:4,blocksize=8")
    nmcompile.finalize(cached, calibration=batches(), sequential=True, calibration_options=AOT)
    compiled = torch.compile(rerun, backend="nmsparse", options=AOT)

    def calibration():
        with torch.no_grad():
            for b in batches():
                compiled(b)

    report = nmcompile.finalize(rerun, calibration=calibration, sequential=True)
    assert report.calibration == "sequential, as asked"
    for (name, a), b in zip(cached.named_parameters(), rerun.parameters()):
        assert torch.equal(a == 0, b == 0), name  # the same masks
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("recipe", ["sparsegpt:2:4,blocksize=8", "wanda:2:4"])
def test_rerunning_the_model_solves_the_blocks_in_the_order_they_run_and_names_it(recipe):
    torch.manual_seed(6)
    model = Chained(order=[2, 0, 1]).eval()
    want = reference(model, batches(), recipe)
    nmcompile.annotate(model, recipe)
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    passes = []

    def calibration():
        with torch.no_grad():
            for b in batches():
                compiled(b)
        passes.append([int(block.fc1.weight_nm_count) for block in model.layers])

    report = nmcompile.finalize(model, calibration=calibration, sequential=True)
    assert passes == [[-1, -1, 120], [120, -1, -1], [-1, 120, -1]]  # layers.2 first: it runs first
    assert "blocks solved in the order the model ran them: layers.2, layers.0, layers.1" in report.calibration
    for (name, got), theirs in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(got, theirs, rtol=1e-4, atol=1e-4, msg=name)


class Skipping(nn.Module):
    """Runs layers.1 only when asked to: the first forward of the calibration does not reach it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, every=False):
        for k in (2, 1, 0) if every else (2, 0):
            x = torch.tanh(self.layers[k](x))
        return x


def test_a_block_the_first_forward_does_not_run_is_solved_last_and_named():
    torch.manual_seed(7)
    model = Skipping().eval()
    nmcompile.annotate(model, "wanda:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)
    data = [torch.randn(20, 16) for _ in range(2)]

    def calibration():
        with torch.no_grad():
            compiled(data[0])
            compiled(data[1], every=True)

    with pytest.warns(UserWarning, match=r"layers.1 did not run in the model's first forward.*solved last"):
        report = nmcompile.finalize(model, calibration=calibration, sequential=True)
    assert "the order the model ran them: layers.2, layers.0, layers.1" in report.calibration
    assert nmcompile.check(model).ok


class Unchained(nn.Module):
    """The activation sits between the blocks: a block's input is not the block before it's output."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_blocks_that_do_not_chain_fall_back_to_rerunning_the_model_and_say_why():
    torch.manual_seed(2)
    model = Unchained().eval()
    data = [torch.randn(20, 16) for _ in range(2)]
    want = copy.deepcopy(model)
    with torch.no_grad():
        x = torch.cat(data)
        for layer in want.layers:
            layer.weight.copy_(ref.wanda(layer.weight, x, 2, 4))
            x = torch.tanh(layer(x))
    nmcompile.annotate(model, "wanda:2:4")
    report = nmcompile.finalize(model, calibration=data, sequential=True, calibration_options=AOT)
    assert "the model ran again before each block (the input of layers.1 is not the output of layers.0" in report.calibration
    for a, b in zip(model.parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_an_error_in_a_later_block_names_the_blocks_already_written():
    torch.manual_seed(3)
    model = Chained().eval()
    model.layers[1].poison.fill_(float("nan"))
    dense = copy.deepcopy(model)
    nmcompile.annotate(model, "sparsegpt:2:4")
    with pytest.raises(ValueError, match=r"(?s)layers.1.fc1.weight.*not finite.*1 of 3 blocks were already pruned and "
                                         r"written in place \(layers.0 .. layers.0\)"):
        nmcompile.finalize(model, calibration=batches(), sequential=True, calibration_options=AOT)
    assert not torch.equal(model.layers[0].fc1.weight, dense.layers[0].fc1.weight)
    assert torch.equal(model.layers[2].fc1.weight, dense.layers[2].fc1.weight)
    assert all(int(c) >= 0 for n, c in model.named_buffers() if n.endswith("_count"))


def test_any_other_error_in_a_later_block_keeps_its_type_and_notes_the_blocks_written(monkeypatch):
    from nmcompile.oneshot import solve as oneshot

    torch.manual_seed(3)
    model = Chained().eval()
    dense = copy.deepcopy(model)
    solve = oneshot.solve_one

    def failing(name, *args, **kwargs):
        if name.startswith("layers.1."):
            raise RuntimeError("out of memory (injected)")
        return solve(name, *args, **kwargs)

    monkeypatch.setattr(oneshot, "solve_one", failing)
    nmcompile.annotate(model, "sparsegpt:2:4")
    with pytest.raises(RuntimeError, match="injected") as caught:
        nmcompile.finalize(model, calibration=batches(), sequential=True, calibration_options=AOT)
    if sys.version_info >= (3, 11):
        assert any("1 of 3 blocks were already pruned and written in place (layers.0 .. layers.0)" in note
                   for note in caught.value.__notes__)
    assert not torch.equal(model.layers[0].fc1.weight, dense.layers[0].fc1.weight)
    assert torch.equal(model.layers[2].fc1.weight, dense.layers[2].fc1.weight)


class _NoNotes(RuntimeError):
    """An error without ``add_note``, as every exception is on Python 3.10."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_without_add_note_the_blocks_written_are_named_in_a_warning():
    err = _NoNotes("interrupted")
    with pytest.warns(UserWarning, match=r"2 of 5 blocks were already pruned and written in place \(layers.0 .. "
                      r"layers.1\)"):
        half_written(err, ["layers.0", "layers.1"], 5)
    assert not hasattr(err, "__notes__")


def test_large_activations_spill_to_disk_and_give_the_same_weights(monkeypatch):
    torch.manual_seed(4)
    model = Chained().eval()
    other = copy.deepcopy(model)
    for m in (model, other):
        nmcompile.annotate(m, "wanda:2:4")
    nmcompile.finalize(model, calibration=batches(), sequential=True, calibration_options=AOT)
    monkeypatch.setattr(sequential, "SPILL_FRACTION", 0.0)
    spilled = []
    real = sequential._Activations._spill
    monkeypatch.setattr(sequential._Activations, "_spill", lambda self, t: spilled.append(1) or real(self, t))
    nmcompile.finalize(other, calibration=batches(), sequential=True, calibration_options=AOT)
    assert spilled
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_the_default_form_is_chosen_by_memory_and_named(monkeypatch):
    model = Chained().eval()
    nmcompile.annotate(model, "wanda:2:4")
    report = nmcompile.finalize(copy.deepcopy(model), calibration=batches(), calibration_options=AOT)
    assert report.calibration.startswith("one pass: every weight's statistics fit")
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    report = nmcompile.finalize(model, calibration=batches(), calibration_options=AOT)
    assert report.calibration.startswith("sequential: one pass would hold every weight's statistics at once")


def test_calibration_batches_of_the_wrong_kind_are_named():
    model = Chained().eval()
    nmcompile.annotate(model, "wanda:2:4")
    with pytest.raises(TypeError, match=r"one batch: pass \[batch\]"):
        nmcompile.finalize(model, calibration=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="got no batches"):
        nmcompile.finalize(model, calibration=[])


def hf_model(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False)
        return transformers.GPT2LMHeadModel(config).eval()
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small)).eval()
    config = transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config).eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "mixtral"])
def test_hugging_face_blocks_run_alone_and_match_rerunning_the_model(kind):
    cached = hf_model(kind)
    rerun = copy.deepcopy(cached)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (4, 16), generator=g), "use_cache": False} for _ in range(2)]
    for model in (cached, rerun):
        nmcompile.annotate(model, "sparsegpt:2:4,blocksize=8")
    report = nmcompile.finalize(cached, calibration=data, sequential=True, calibration_options=AOT)
    assert "each block ran alone on its cached inputs" in report.calibration, report.calibration
    compiled = torch.compile(rerun, backend="nmsparse", options=AOT)

    def calibration():
        with torch.no_grad():
            for batch in data:
                compiled(**batch)

    nmcompile.finalize(rerun, calibration=calibration, sequential=True)
    assert nmcompile.check(cached).ok
    for (name, a), b in zip(cached.named_parameters(), rerun.parameters()):
        assert float((a == 0).ne(b == 0).float().mean()) < 0.01, name  # the same masks, but for float ties
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)


def test_an_error_in_a_later_block_of_the_rerun_form_names_the_blocks_already_written():
    torch.manual_seed(3)
    model = Chained().eval()
    model.layers[1].poison.fill_(float("nan"))
    nmcompile.annotate(model, "sparsegpt:2:4")
    compiled = torch.compile(model, backend="nmsparse", options=AOT)

    def calibration():
        with torch.no_grad():
            for b in batches():
                compiled(b)

    with pytest.raises(ValueError, match=r"(?s)layers.1.fc1.weight.*not finite.*1 of 3 blocks were already pruned and "
                                         r"written in place \(layers.0 .. layers.0\)"):
        nmcompile.finalize(model, calibration=calibration, sequential=True)
