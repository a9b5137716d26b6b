"""Distillation from the dense model: the loss that gets back what pruning cost, with the N:M mask kept.

The student is the pruned model, declared with a recipe that keeps its mask (``asp:2:4,permute=0``: its mask of
an N:M weight is exactly the weight's non-zeros) or learns it further (``sr_ste:2:4``) and compiled with
``backend="nmsparse"`` as any training run is; the teacher is the dense model it was pruned from. Per batch::

    loss = logits * T^2 * KL(softmax(t / T) || softmax(s / T))          (mean over positions)
         + layers * sum_l mean((h_l^s - h_l^t)^2) / var(h_l^t)          (SquareHead's layer-wise term)
         + task   * the task's loss on the student's logits             (cross entropy on the labels)

``t``/``s`` the teacher's and student's logits, ``h_l`` each block's output (the modules ``blocks`` names; by
default the blocks of the first ``nn.ModuleList`` of modules, a transformer's layers), ``var`` over all of the
teacher's values at that block. The teacher runs under ``no_grad`` and in eval mode, in the student's dtype (a
teacher of another floating dtype is refused by name: cast it), sharded however the caller sharded it (under
FSDP2, ``fully_shard`` it as the student is: its forward gathers its own shards).

:class:`Distillation` holds both models and forward hooks on the named blocks of each while it lives (``close()``,
or use it as a context manager, removes them); the hooks only keep each block's output for the loss. Call it
with the student's forward (a compiled one is fine) and the batch: ``loss = distill(compiled, ids, labels)``; in a
Hugging Face ``Trainer``, :class:`nmcompile.training.distill_trainer.DistillationTrainer` does that.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Distillation", "kl_divergence", "normalized_mse", "blocks_of"]


def kl_divergence(student: Tensor, teacher: Tensor, temperature: float = 1.0) -> Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` over the last dim, averaged over every other
    position (computed in fp32)."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature ** 2


def normalized_mse(student: Tensor, teacher: Tensor) -> Tensor:
    """SquareHead's term for one block: ``mean((student - teacher)^2) / var(teacher)`` (fp32; the variance over
    every value of ``teacher``, floored at 1e-12)."""
    t = teacher.float()
    return (student.float() - t).pow(2).mean() / t.var(unbiased=False).clamp_min(1e-12)


def _output(value):
    """The hidden state a block returns: itself, or the first element of a tuple (transformers' layers)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def blocks_of(model: nn.Module, blocks: str | list[str] | None = "auto") -> list[str]:
    """The module names whose outputs the layer-wise term matches: ``"auto"``, the children of the first
    ``nn.ModuleList`` (in module order) whose children are modules with parameters; a glob or list of globs of
    module names; None: none."""
    if blocks is None:
        return []
    names = dict(model.named_modules())
    if blocks == "auto":
        for name, module in names.items():
            if isinstance(module, nn.ModuleList) and len(module) and all(any(True for _ in c.parameters())
                                                                        for c in module):
                return [f"{name}.{i}" if name else str(i) for i in range(len(module))]
        raise ValueError(f"Distillation: {type(model).__name__} has no nn.ModuleList of blocks for the layer-wise "
                         "term; name its blocks (blocks='layers.*') or set layers=0")
    globs = [blocks] if isinstance(blocks, str) else list(blocks)
    found = [n for n in names if n and any(fnmatch.fnmatchcase(n, g) for g in globs)]
    if not found:
        raise ValueError(f"Distillation: blocks={blocks!r} names no module of {type(model).__name__}")
    return found


class Distillation:
    """The distillation loss of ``student`` (the pruned model) against ``teacher`` (the dense one); see the module
    doc. ``logits``, ``layers``, ``task``: the weights of the three terms; ``temperature``: the KL's;
    ``teacher_forward``: how the teacher runs (default the module itself; a compiled teacher, say, where that
    pays: the hooks on its blocks hold there too)."""

    def __init__(self, student: nn.Module, teacher: nn.Module, *, temperature: float = 1.0, logits: float = 1.0,
                 layers: float = 0.0, task: float = 0.0, blocks: str | list[str] | None = "auto",
                 teacher_forward=None):
        if temperature <= 0 or min(logits, layers, task) < 0 or logits + layers + task <= 0:
            raise ValueError(f"Distillation: temperature {temperature!r} must be > 0 and the weights logits={logits!r}, "
                             f"layers={layers!r}, task={task!r} >= 0, not all 0")
        dtypes = {p.dtype for p in student.parameters() if p.is_floating_point()}
        other = {p.dtype for p in teacher.parameters() if p.is_floating_point()} - dtypes
        if other:
            raise ValueError(f"Distillation: the teacher holds {sorted(map(str, other))} weights, the student "
                             f"{sorted(map(str, dtypes))}; cast the teacher to the student's dtype "
                             "(teacher.to(dtype)) so both compute alike")
        self.student, self.teacher = student, teacher.eval()
        self.teacher_forward = teacher if teacher_forward is None else teacher_forward
        self.temperature, self.weights = float(temperature), {"logits": logits, "layers": layers, "task": task}
        self.blocks = blocks_of(student, blocks) if layers else []
        missing = [n for n in self.blocks if n not in dict(teacher.named_modules())]
        if missing:
            raise ValueError(f"Distillation: the teacher has no module {missing[0]!r} to match the student's; "
                             "name blocks both models have (blocks=...)")
        self._seen: dict[str, list[Tensor]] = {"student": [], "teacher": []}
        self._hooks = []
        for role, model in (("student", student), ("teacher", teacher)):
            modules = dict(model.named_modules())
            for name in self.blocks:
                self._hooks.append(modules[name].register_forward_hook(
                    lambda _m, _a, out, seen=self._seen[role]: seen.append(_output(out))))
        self.last: dict[str, float] = {}  # the terms of the last call, as floats

    def __call__(self, forward, inputs, labels: Tensor | None = None, task_loss=None) -> Tensor:
        """The loss of one batch: ``forward(inputs)`` (the student's, compiled or not) against the teacher's
        (``teacher_forward(inputs)``, or ``teacher_forward(**inputs)`` where ``inputs`` is a dict of keyword
        arguments, a Hugging Face batch without its labels).
        ``labels`` and ``task_loss(logits, labels)`` (default: cross entropy over the last dim) for the task term."""
        for seen in self._seen.values():
            seen.clear()
        with torch.no_grad():
            teacher = _logits(self.teacher_forward(**inputs) if isinstance(inputs, Mapping) else
                              self.teacher_forward(inputs))
        student = _logits(forward(inputs))
        if len(self._seen["student"]) != len(self.blocks) or len(self._seen["teacher"]) != len(self.blocks):
            raise RuntimeError(f"Distillation: {len(self.blocks)} blocks are matched, the student's forward ran "
                               f"{len(self._seen['student'])} and the teacher's {len(self._seen['teacher'])} of "
                               "them; call it with the student model the Distillation was made for")
        terms: dict[str, Tensor] = {}
        if self.weights["logits"]:
            terms["logits"] = kl_divergence(student, teacher, self.temperature)
        if self.weights["layers"]:
            terms["layers"] = sum(normalized_mse(s, t) for s, t in zip(self._seen["student"], self._seen["teacher"]))
        if self.weights["task"]:
            if labels is None:
                raise ValueError("Distillation: task > 0 needs the batch's labels")
            terms["task"] = task_loss(student, labels) if task_loss else \
                F.cross_entropy(student.float().reshape(-1, student.shape[-1]), labels.reshape(-1))
        for seen in self._seen.values():
            seen.clear()
        self.last = {k: float(v.detach()) for k, v in terms.items()}
        return sum(self.weights[k] * v for k, v in terms.items())

    def close(self) -> None:
        """Remove the hooks from both models."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __enter__(self) -> Distillation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _logits(out) -> Tensor:
    """The logits of a forward's output: a tensor, or a Hugging Face output's ``logits``."""
    logits = getattr(out, "logits", out)
    if not isinstance(logits, Tensor):
        raise TypeError(f"Distillation: the forward returned {type(out).__name__}, neither logits nor an output with "
                        "a .logits tensor")
    return logits
