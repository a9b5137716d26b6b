"""Distillation in a Hugging Face ``Trainer``: :class:`DistillationTrainer`, whose loss is a
:class:`~nmcompile.training.distill.Distillation`'s.

A user's Trainer script changes in three lines: declare the pruned student (``nmcompile.annotate(student,
"asp:2:4,permute=0")``) and compile it as any Trainer run (``student.compile(backend="nmsparse")``), then build
the trainer with the distillation::

    distill = Distillation(student, teacher, task=1.0)
    trainer = DistillationTrainer(model=student, args=args, train_dataset=data, distillation=distill)

Each batch runs the teacher (no grad, eval mode) and the student on the batch's inputs (every key but
``labels``, given as keywords); the task term is the causal language model's loss on ``labels`` (shifted by one,
``-100`` ignored), or ``task_loss(logits, labels)`` where given. The loss is the mean over the batch's positions
(gradient accumulation averages the micro-batches' means). ``transformers`` is imported with this module: import it
only where the Trainer is used.
"""

from __future__ import annotations

import torch.nn.functional as F
import transformers
from torch import Tensor

from .distill import Distillation

__all__ = ["DistillationTrainer", "causal_lm_loss"]


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross entropy of ``logits[:, :-1]`` against ``labels[:, 1:]`` (fp32), positions labelled -100 left out."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


class DistillationTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose loss is ``distillation``'s (see the module doc); every other argument is the
    Trainer's own. ``distillation`` must be made for the model the Trainer trains (its hooks sit on its blocks)."""

    def __init__(self, *args, distillation: Distillation, task_loss=causal_lm_loss, **kwargs):
        if not isinstance(distillation, Distillation):
            raise TypeError(f"DistillationTrainer: distillation= takes an nmcompile Distillation, got "
                            f"{type(distillation).__name__}")
        super().__init__(*args, **kwargs)
        self.distillation, self.task_loss = distillation, task_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        kept = {}

        def forward(batch):
            kept["out"] = model(**batch)
            return kept["out"]

        loss = self.distillation(forward, inputs, labels, self.task_loss)
        return (loss, kept["out"]) if return_outputs else loss
