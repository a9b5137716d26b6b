"""The Hugging Face ``Trainer`` route (docs/integrations.md), on CPU with a tiny random GPT-2.

A user's Trainer script gains only the nmcompile lines before the Trainer is built:
``nmcompile.annotate(model, recipe)`` and ``model.compile(backend="nmsparse")`` (the Trainer's own
``torch_compile_backend`` rejects names it does not know); recipes with a schedule count the
Trainer's own optimizer steps. Checked here: the checkpoint holds the
recipe state and ``resume_from_checkpoint`` continues bit-exactly; a stateless recipe works from
``NMSPARSE_RECIPE`` alone; a stateful one declared that way and resumed says what it could not
restore and how to declare it so that it can.

Every model compiles with ``inner="aot_eager"`` (no Inductor) to keep CI fast.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch.utils.data import Dataset

import nmcompile

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
load_file = pytest.importorskip("safetensors.torch").load_file  # the format of Trainer checkpoints

pytestmark = pytest.mark.slow

AOT = {"inner": "aot_eager"}
VOCAB, LENGTH = 64, 16
BLOCKS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
WEIGHTS = [f"transformer.h.{i}.{b}.weight" for i in range(2) for b in BLOCKS]
FRESH = "starts fresh from the weights as they are now"
# two clocked recipes: MDGF's decay factor moves every step, the transposable mask every 2 steps
CLOCKED = {"*.attn.*": "mdgf:2:4,decay_coef=0.3", "*.mlp.*": "transposable:2:4,every=2"}


class Tokens(Dataset):
    """Random token sequences from a seeded generator (a causal LM learns them as its labels)."""

    def __init__(self, n: int = 48, seed: int = 0):
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config)


def trainer_for(model, out, *, steps: int, save_steps: int | None = None, optimizers=(None, None)):
    args = transformers.TrainingArguments(
        output_dir=str(out), use_cpu=True, report_to=[], max_steps=steps, seed=0, data_seed=0,
        per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, dataloader_num_workers=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=optimizers)


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def n_violations(w: torch.Tensor, dim: int, n: int = 2, m: int = 4) -> int:
    """Groups of ``m`` along ``dim`` with more than ``n`` non-zeros (independent of nmcompile)."""
    g = w.detach().movedim(dim, -1)
    return int(((g.reshape(*g.shape[:-1], -1, m) != 0).sum(-1) > n).sum())


def train_annotated(out, resume=None):
    """The user's script: a Trainer run plus the nmcompile lines before the Trainer is built."""
    model = gpt2()
    report = nmcompile.annotate(model, CLOCKED)  # recipe state becomes buffers, saved in checkpoints
    model.compile(backend="nmsparse", options=AOT)
    trainer = trainer_for(model, out, steps=6, save_steps=3)  # the Trainer's own optimizer and schedule
    trainer.train(resume_from_checkpoint=resume)
    return model, report, losses(trainer)


def test_checkpoint_holds_recipe_state_and_resume_is_exact(tmp_path):
    full, report, full_losses = train_annotated(tmp_path / "full")
    assert sorted(report.annotated) == sorted(WEIGHTS)
    assert sorted(full_losses) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in full_losses.values())

    checkpoint = tmp_path / "full" / "checkpoint-3"
    saved = load_file(str(checkpoint / "model.safetensors"))
    state_keys = {k for k in saved if "_nm_" in k}
    expected = {f"{w}_nm_step" for w in WEIGHTS} | {f"{w}_nm_mask" for w in WEIGHTS if ".mlp." in w}
    assert state_keys == expected
    for w in WEIGHTS:  # the clock counts the optimizer steps up to the checkpoint
        assert saved[f"{w}_nm_step"].item() == 3, w

    resumed, _, resumed_losses = train_annotated(tmp_path / "resumed", resume=str(checkpoint))
    for step in (4, 5, 6):  # logged by the resumed run itself (its log history up to 3 is restored)
        assert resumed_losses[step] == full_losses[step], step
    a, b = full.state_dict(), resumed.state_dict()  # parameters and recipe state
    assert a.keys() == b.keys() and any("_nm_" in k for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == []
    ea, eb = nmcompile.effective_weights(full), nmcompile.effective_weights(resumed)
    assert sorted(ea) == sorted(WEIGHTS) and sorted(eb) == sorted(WEIGHTS)
    assert [k for k in ea if not torch.equal(ea[k], eb[k])] == []
    # transposable forward weights are 2:4 (along dim 0, and along dim 1 too); MDGF's still carry
    # the pruned weights, scaled by exp(-0.3 * 6)
    assert all(n_violations(ea[w], 0) == 0 and n_violations(ea[w], 1) == 0 for w in WEIGHTS if ".mlp." in w)
    assert all(n_violations(ea[w], 0) > 0 for w in WEIGHTS if ".attn." in w)


def test_scheduled_recipe_from_the_environment_alone_counts_the_trainers_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("NMSPARSE_RECIPE", "transposable:2:4,every=2")
    model = gpt2()
    model.compile(backend="nmsparse", options=AOT)  # the user's script: no nmcompile call at all
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # state made at the first forward (named there)
        trainer_for(model, tmp_path, steps=4).train()
    steps = {k: int(v) for k, v in model.state_dict().items() if k.endswith("_nm_step")}
    assert sorted(k[: -len("_nm_step")] for k in steps) == sorted(WEIGHTS)
    assert set(steps.values()) == {4}
    assert nmcompile.check(model).ok


def test_stateless_recipe_from_the_environment_alone(tmp_path, monkeypatch, recwarn):
    monkeypatch.setenv("NMSPARSE_RECIPE", "sr_ste:2:4")

    # --- the user's script: no nmcompile import, only the compile line before the Trainer ---
    model = gpt2()
    model.compile(backend="nmsparse", options=AOT)  # options only to skip Inductor in CI
    trainer = trainer_for(model, tmp_path, steps=3)
    trainer.train()
    # ------------------------------------------------------------------------------------------

    logged = losses(trainer)
    assert sorted(logged) == [1, 2, 3] and all(math.isfinite(v) for v in logged.values())
    effective = nmcompile.effective_weights(model)
    assert sorted(effective) == sorted(WEIGHTS)  # the backend saw exactly these (not wte / lm_head)
    report = nmcompile.check(model)
    assert report.ok, report
    for name, w in effective.items():  # Conv1D weights are [in, out]: groups along dim 0
        assert n_violations(w, 0) == 0, name
        assert n_violations(model.get_parameter(name), 0) > 0, name  # the dense weight trains on
    assert not [w for w in recwarn if FRESH in str(w.message)]  # sr_ste has no state to lose


def test_stateful_recipe_from_the_environment_says_what_resume_cannot_restore(tmp_path, monkeypatch):
    monkeypatch.setenv("NMSPARSE_RECIPE", "s_ste:2:4")
    first = r"transformer\.h\.0\.attn\.c_attn\.weight \(s_ste:2:4 from NMSPARSE_RECIPE\)"
    fix = r"nmcompile\.annotate\(model, os\.environ\['NMSPARSE_RECIPE'\]\)"

    def run(out, steps, resume=None, annotate=False):
        model = gpt2()
        if annotate:
            nmcompile.annotate(model, "s_ste:2:4")
        model.compile(backend="nmsparse", options=AOT)
        trainer_for(model, out, steps=steps, save_steps=3).train(resume_from_checkpoint=resume)
        return model

    with pytest.warns(UserWarning, match=first):  # also said on a fresh run: the state is made lazily
        run(tmp_path / "a", steps=3)
    checkpoint = tmp_path / "a" / "checkpoint-3"
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert {k for k in saved if "_nm_" in k} == {f"{w}_nm_beta" for w in WEIGHTS}

    with pytest.warns(UserWarning, match=f"{FRESH}: {first}.*resume_from_checkpoint.*not restored.*{fix}") as got:
        resumed = run(tmp_path / "b", steps=4, resume=str(checkpoint))
    # said once per compiled graph, counting every weight whose state could not be restored
    counts = [re.search(r"recipe state for (\d+) weight", str(m.message)) for m in got]
    assert sum(int(c.group(1)) for c in counts if c) == len(WEIGHTS)
    assert len([c for c in counts if c]) < len(WEIGHTS)
    # what the warning says is true: beta was recomputed from the resumed weights, not restored
    state = resumed.state_dict()
    assert not any(torch.equal(state[f"{w}_nm_beta"], saved[f"{w}_nm_beta"]) for w in WEIGHTS)

    # the fix it names: declared before the Trainer loads, the saved beta is restored (and kept:
    # S-STE computes beta once), and nothing is said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fixed = run(tmp_path / "c", steps=4, resume=str(checkpoint), annotate=True)
    assert not [w for w in caught if FRESH in str(w.message)]
    state = fixed.state_dict()
    assert all(torch.equal(state[f"{w}_nm_beta"], saved[f"{w}_nm_beta"]) for w in WEIGHTS)


def test_distillation_trainer_trains_the_pruned_student_on_the_teachers_logits(tmp_path):
    """``DistillationTrainer``: the loss of a batch is the teacher's logits' KL plus the causal LM's loss (from the
    equations), training through the Trainer lowers the KL to the teacher and keeps each weight's 2:4 mask."""
    from nmcompile.training.distill import Distillation
    from nmcompile.training.distill_trainer import DistillationTrainer

    from reference import distillation_kl

    teacher, student = gpt2(), gpt2()
    with torch.no_grad():  # weights 6x the initial scale: logits far from uniform, so that pruning costs something
        for p in teacher.parameters():
            p.mul_(6.0 if p.dim() == 2 else 1.0)
    student.load_state_dict(teacher.state_dict())
    report = nmcompile.annotate(student, "asp:2:4,permute=0")
    assert sorted(report.annotated) == sorted(WEIGHTS)
    masks = {n: student.get_submodule(n.rsplit(".", 1)[0]).weight_nm_mask.clone() for n in WEIGHTS}
    student.compile(backend="nmsparse", options=AOT)
    ids = Tokens().ids[:4]

    def kl_now():
        with torch.no_grad():
            return distillation_kl(student(input_ids=ids).logits, teacher(input_ids=ids).logits, 1.0)

    with Distillation(student, teacher, task=0.1) as distill:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=12, seed=0, data_seed=0,
            per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1, dataloader_num_workers=0,
            save_strategy="no", disable_tqdm=True)
        trainer = DistillationTrainer(model=student, args=args, train_dataset=Tokens(), distillation=distill)
        loss = trainer.compute_loss(student, {"input_ids": ids, "labels": ids})
        with torch.no_grad():
            s, t = student(input_ids=ids).logits, teacher(input_ids=ids).logits
        ce = torch.nn.functional.cross_entropy(s[:, :-1].double().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        assert float(loss) == pytest.approx(distillation_kl(s, t, 1.0) + 0.1 * float(ce), abs=1e-5)
        before = kl_now()
        trainer.train()
    assert len(losses(trainer)) == 12
    assert kl_now() < 0.7 * before  # 0.177 -> 0.094 when written
    for name in WEIGHTS:
        w = student.get_submodule(name.rsplit(".", 1)[0]).weight
        kept = nmcompile.deploy.effective_weights(student)[name]
        assert torch.equal(kept != 0, masks[name].bool() & (w.detach() != 0)) and n_violations(kept, 0) == 0
    with pytest.raises(TypeError, match="distillation= takes an nmcompile Distillation, got dict"):
        DistillationTrainer(model=student, args=args, distillation={})
