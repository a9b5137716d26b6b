"""Distillation from the dense teacher (``nmcompile.training.distill``): the terms against references written
from their definitions, the loss of a compiled 2:4 student the eager one's, the teacher never trained, the mask
kept, and bad input refused by name."""

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.app.chargpt import CharGPT, GPTConfig
from nmcompile.training.distill import Distillation, blocks_of, kl_divergence, normalized_mse

import reference as ref


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_the_kl_term_is_the_soft_target_loss(temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11) * 3, torch.randn(3, 5, 11) * 3
    got = float(kl_divergence(student, teacher, temperature))
    assert got == pytest.approx(ref.distillation_kl(student, teacher, temperature), rel=1e-5, abs=1e-7)
    assert float(kl_divergence(teacher, teacher, temperature)) == pytest.approx(0.0, abs=1e-6)


def test_the_layer_term_is_squarehead_and_bf16_is_computed_in_fp32():
    torch.manual_seed(0)
    states = [(torch.randn(2, 7, 16), torch.randn(2, 7, 16) * 2 + 1) for _ in range(3)]
    got = sum(float(normalized_mse(s, t)) for s, t in states)
    assert got == pytest.approx(ref.squarehead(*zip(*states)), rel=1e-5)
    s, t = states[0]
    assert float(normalized_mse(s.bfloat16(), t.bfloat16())) == pytest.approx(
        ref.squarehead([s.bfloat16()], [t.bfloat16()]), rel=1e-5)


def _pair(seed=0):
    torch.manual_seed(seed)
    config = GPTConfig(vocab=32, context=16, width=64, layers=2)
    teacher = CharGPT(config)
    student = CharGPT(config)
    student.load_state_dict(teacher.state_dict())
    with torch.no_grad():  # the pruned one: its linears 2:4 by magnitude
        for name, p in student.named_parameters():
            if p.dim() == 2 and not name.startswith(("tokens", "positions", "head")):
                p.mul_(ref.topn_mask(p, 2, 4))
    return student, teacher


def test_the_loss_is_its_weighted_terms_and_the_blocks_are_the_model_layers():
    student, teacher = _pair()
    ids, labels = torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    assert blocks_of(student) == ["blocks.0", "blocks.1"]
    with Distillation(student, teacher, temperature=2.0, logits=0.5, layers=0.25, task=2.0) as distill:
        loss = distill(student, ids, labels)
        states = {}
        hooks = [m.register_forward_hook(lambda m, a, o, k=(role, name): states.__setitem__(k, o))
                 for role, model in (("s", student), ("t", teacher)) for name, m in model.named_modules()
                 if name in ("blocks.0", "blocks.1")]
        with torch.no_grad():
            s_logits, t_logits = student(ids), teacher(ids)
        for hook in hooks:
            hook.remove()
    expected = (0.5 * ref.distillation_kl(s_logits, t_logits, 2.0)
                + 0.25 * ref.squarehead([states[("s", n)] for n in ("blocks.0", "blocks.1")],
                                        [states[("t", n)] for n in ("blocks.0", "blocks.1")])
                + 2.0 * float(torch.nn.functional.cross_entropy(s_logits.reshape(-1, 32), labels.reshape(-1))))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert set(distill.last) == {"logits", "layers", "task"}
    seen = []  # a teacher_forward (a compiled teacher, say) runs the teacher instead of calling it
    with Distillation(student, teacher, temperature=2.0, logits=0.5, layers=0.25, task=2.0,
                      teacher_forward=lambda x: seen.append(1) or teacher(x)) as other:
        assert float(other(student, ids, labels).detach()) == pytest.approx(expected, rel=1e-5) and seen == [1]
    assert not any(m._forward_hooks for m in [*student.modules(), *teacher.modules()])  # closed: hooks gone


def test_a_compiled_2_4_student_learns_from_the_teacher_with_its_mask_kept():
    student, teacher = _pair()
    nmcompile.annotate(student, "asp:2:4,permute=0", exclude=["head"])
    zeros = {n: p == 0 for n, p in student.named_parameters() if p.dim() == 2 and bool((p == 0).any())}
    assert len(zeros) == 8
    compiled = torch.compile(student, backend="nmsparse", options={"inner": "aot_eager"}, dynamic=False)
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    ids = torch.randint(0, 32, (4, 16))
    with Distillation(student, teacher, layers=1.0) as distill:
        eager = float(distill(student, ids))
        losses = []
        for _ in range(8):
            loss = distill(compiled, ids)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    assert losses[0] == pytest.approx(eager, rel=1e-4, abs=1e-6)  # the compiled student's loss is the eager one's
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.grad is None and torch.equal(p, before[n]) for n, p in teacher.named_parameters())
    effective = nmcompile.effective_weights(student)
    assert all(bool((effective[n][z] == 0).all()) for n, z in zeros.items())


def test_bad_input_is_refused_by_name():
    student, teacher = _pair()
    with pytest.raises(ValueError, match=r"teacher holds \['torch.bfloat16'\] weights.*teacher.to\(dtype\)"):
        Distillation(student, teacher.bfloat16())
    student, teacher = _pair()
    with pytest.raises(ValueError, match=r"temperature 0 must be > 0"):
        Distillation(student, teacher, temperature=0)
    with pytest.raises(ValueError, match=r"blocks='layers.\*' names no module of CharGPT"):
        Distillation(student, teacher, layers=1.0, blocks="layers.*")
    with pytest.raises(ValueError, match=r"has no nn.ModuleList of blocks"):
        Distillation(nn.Linear(4, 4), nn.Linear(4, 4), layers=1.0)
    with Distillation(student, teacher, task=1.0) as distill, pytest.raises(ValueError, match="needs the batch's labels"):
        distill(student, torch.randint(0, 32, (2, 16)))
    other, _ = _pair(1)
    with Distillation(student, teacher, layers=1.0) as distill, pytest.raises(RuntimeError, match="ran 0 and the teacher"):
        distill(other, torch.randint(0, 32, (2, 16)))  # another student than the hooks were put on
