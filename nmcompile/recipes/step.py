"""STEP: N:M masks learned with Adam's second moment frozen as a preconditioner (ICML 2023, arXiv 2302.01172).

Two phases, switched for all STEP weights of a model at once:

1. **Precondition.** Dense training with the user's Adam/AdamW. Before every optimizer step the
   change of the second moment, ``dv = (1 - b2) (g^2 - v)``, is summarised over all STEP weights as
   ``Z_t``: its mean ``|dv|`` (``z_option=1``), or its geometric mean (``z_option=2``) with exact
   zeros floored at the threshold: an unused row has ``dv = 0``, whose ``log`` would make the mean
   zero and force the switch; at the threshold it is neutral, neither for nor against switching. **AutoSwitch** fires at step t when the mean of the last ``floor(1/(1 - b2))`` samples
   is below the threshold (Adam's ``eps``) and ``t > t_min``, or when ``t >= t_max`` (``t_min``,
   ``t_max``: fractions of ``total_steps``).
2. **Mask learning.** Forward with the hard top-N mask (straight-through gradient, plus the
   SR-STE term ``decay * (1 - m) * W`` when ``decay > 0``). Adam's bias-corrected second moment
   at the switch is frozen in the ``v`` state; for STEP weights this module performs the update
   ``W -= lr * m_hat / (sqrt(v_frozen) + eps)`` (first moment and decoupled or L2 weight decay as
   the optimizer is configured) and hides their gradient from the optimizer's own step.
   Entries whose second moment was exactly zero at the switch (no gradient ever reached them,
   e.g. a dead ReLU unit) have nothing to freeze: dividing by ``eps`` alone would blow up the
   first gradient they get when the mask changes, so they use Adam's live second moment, which
   keeps being updated in phase 2.

Everything is in the weight's state: ``step``, ``phase``, ``switch_step`` (-1 before), ``z`` (the
window of Z_t samples) and ``v``. The optimizer's own state keeps the first moment.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..state.clock import new_step
from ..state.sharding import full, is_sharded, local, shard_of, sum_over_ranks
from .base import Recipe
from .step_kernels import change_sum, frozen_update


def _decoupled(optimizer, group) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


@dataclass(frozen=True, kw_only=True)
class STEP(Recipe):
    name = "step"
    state_names = ("step", "phase", "switch_step", "z", "v")
    clocked = True
    reads_gradients = True

    total_steps: int = 0  # required: the run's number of optimizer steps
    t_min: float = 0.1  # AutoSwitch may fire after this fraction of total_steps
    t_max: float = 0.5  # ... and fires at this fraction at the latest
    z_option: int = 1  # 1: mean |dv|; 2: geometric mean of |dv|, zeros floored at the threshold
    decay: float = 0.0  # SR-STE's term in phase 2 (off by default)
    beta2: float = 0.999  # the optimizer's beta2; sets the window floor(1/(1 - beta2)) (checked)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total_steps <= 0:
            raise ValueError(
                "step needs total_steps (the run's number of optimizer steps; t_min and t_max are "
                f"fractions of it), e.g. step:{self.n}:{self.m},total_steps=10000"
            )
        if not 0 <= self.t_min <= self.t_max <= 1:
            raise ValueError(f"step: need 0 <= t_min <= t_max <= 1 (fractions of total_steps), got {self.t_min}, {self.t_max}")
        if self.z_option not in (1, 2):
            raise ValueError(f"step: z_option is 1 (mean |dv|) or 2 (floored geometric mean), got {self.z_option}")
        if not self.decay >= 0:
            raise ValueError(f"step: decay must be >= 0, got {self.decay}")
        if not 0 < self.beta2 < 1:
            raise ValueError(f"step: beta2 must be in (0, 1), got {self.beta2}")

    @property
    def window(self) -> int:
        return max(1, math.floor(1 / (1 - self.beta2) + 1e-6))

    @property
    def switch_range(self) -> tuple[int, int]:
        return int(self.t_min * self.total_steps), int(self.t_max * self.total_steps)

    def state_mismatch(self, key: str, shape: tuple[int, ...]) -> str | None:
        if key != "z" or len(shape) != 1 or shape[0] < 2:
            return None
        theirs = float(f"{1 - 1 / shape[0]:.4g}")  # the smallest beta2 with that window
        return (
            f"its Z window holds {shape[0]} samples, floor(1/(1 - beta2)) of a beta2 of about {theirs}, where this "
            f"recipe's beta2={self.beta2} makes {self.window}: the checkpoint was saved with another beta2. Declare "
            f"the recipe with the checkpoint's beta2 (e.g. {dataclasses.replace(self, beta2=theirs)}) and build the "
            "optimizer with the same betas"
        )

    def init_state(self, weight: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        device = weight.device
        return {
            "step": new_step(weight),
            "phase": torch.zeros((), dtype=torch.bool, device=device),
            "switch_step": torch.full((), -1, dtype=torch.int64, device=device),
            "z": torch.zeros(self.window, dtype=torch.float32, device=device),
            "v": torch.zeros(weight.shape, dtype=torch.float32, device=device),
        }

    def project(self, weight, step, phase, switch_step, z, v, dim, frame=None):
        # dense in phase 1, the hard mask in phase 2, in one pass; the SR-STE term of the backward
        # is zero in phase 1, where the output is the weight itself
        return torch.ops.nmsparse.prune_when(weight, phase, self.n, self.m, dim, float(self.decay))

    def forward_gate(self, step, phase, switch_step, z, v):
        return phase  # N:M only after the switch

    def state_problem(self, weight, step, phase, switch_step, z, v, dim):
        switched, at, now = bool(phase), int(switch_step), int(step)
        if switched != (at >= 1) or at > now:
            return f"its phase ({int(switched) + 1}), switch step ({at}) and step clock ({now}) disagree"
        return super().state_problem(weight, step, phase, switch_step, z, v, dim=dim)

    # ---- optimizer time (see nmcompile.training.step_driver) ----

    def _groups(self, weights, optimizer) -> dict[int, dict]:
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(
                f"step recipe on {weights[0].name!r} needs torch.optim.Adam or AdamW (STEP preconditions "
                f"with Adam's second moment), got {type(optimizer).__name__}"
            )
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for w in weights:
            beta2 = groups[id(w.param)]["betas"][1]
            if not math.isclose(float(beta2), self.beta2, rel_tol=1e-9):
                raise ValueError(
                    f"step recipe on {w.name!r} was declared with beta2={self.beta2} but the optimizer uses "
                    f"beta2={beta2}; declare it with the optimizer's value, e.g. step:{self.n}:{self.m},"
                    f"total_steps={self.total_steps},beta2={beta2}"
                )
        return groups

    def before_step(self, weights, optimizer) -> None:
        groups = self._groups(weights, optimizer)
        dense = [w for w in weights if not w.mirror("phase").read(w.state["phase"])]
        for w in weights:
            if not any(w is d for d in dense):
                self._frozen_update(w, groups[id(w.param)], optimizer)
        if dense:
            self._autoswitch(dense, groups, optimizer)

    def _autoswitch(self, weights, groups, optimizer) -> None:
        total, count, eps = 0.0, 0, None
        for w in weights:
            p, group = w.param, groups[id(w.param)]
            eps = group["eps"]
            if p.grad is None:
                continue
            g = local(p.grad).float()  # FSDP2: this rank's rows; the sums are added over ranks below
            if group["weight_decay"] and not _decoupled(optimizer, group):
                g = g + group["weight_decay"] * local(p).float()
            v = local(optimizer.state.get(p, {}).get("exp_avg_sq"))
            # |dv| / (1 - b2) = |g^2 - v|: the constant factor is applied to the mean below
            total = total + change_sum(v, g, self.z_option, eps / (1 - group["betas"][1]))
            count += g.numel()
        params = [w.param for w in weights]
        if any(is_sharded(p) for p in params):  # FSDP2: every rank summed its own rows
            device = local(params[0]).device
            sums = torch.stack([torch.as_tensor(total, dtype=torch.float64, device=device),
                                torch.tensor(float(count), dtype=torch.float64, device=device)])
            total, count = sum_over_ranks(sums, params).unbind()
        if count == 0:
            return
        scale = 1 - self.beta2
        z = scale * total / count if self.z_option == 1 else scale * torch.exp(total / count)
        done = weights[0].ann.clock.read(weights[0].state["step"])  # steps before this one
        t = done + 1
        samples = min(t, self.window)
        for w in weights:
            w.state["z"][done % self.window] = z
            w.ann.trace.append("z", t, z)
        t_min, t_max = self.switch_range
        switch = t >= t_max or (t > t_min and bool(weights[0].state["z"][:samples].mean() < eps))
        if switch:
            for w in weights:
                w.scratch["switch"] = True

    def _frozen_update(self, w, group, optimizer) -> None:
        param = w.param
        if param.grad is None:
            return
        p = local(param)  # FSDP2: the update runs on this rank's rows, in place
        lr = float(group["lr"])
        beta1, _ = group["betas"]
        g = -local(param.grad) if group.get("maximize", False) else local(param.grad)
        wd = group["weight_decay"]
        if wd and _decoupled(optimizer, group):
            p.mul_(1 - lr * wd)
        elif wd:
            g = g + wd * p
        state = optimizer.state[param]
        if "exp_avg" not in state:  # e.g. resumed without optimizer state
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        t = float(state["step"])
        beta2 = group["betas"][1]
        frozen_update(p, g, local(state["exp_avg"]), local(state["exp_avg_sq"]), shard_of(w.state["v"], param),
                      lr=lr, beta1=beta1, beta2=beta2, bias1=1 - beta1**t, bias2=1 - beta2**t, eps=group["eps"])
        w.scratch["grad"] = param.grad
        param.grad = None  # the optimizer's own step skips parameters without a gradient

    def after_step(self, weights, optimizer) -> None:
        for w in weights:
            if w.scratch.pop("switch", False):
                p = w.param
                state = optimizer.state[p]
                group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
                moment = state.get("max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq")
                if moment is None:  # never had a gradient (a frozen layer): nothing to freeze, v stays 0
                    w.state["v"].zero_()
                else:
                    bias2 = 1 - group["betas"][1] ** float(state["step"])
                    w.state["v"].copy_(full(moment).float() / bias2)  # FSDP2: gathered, whole on every rank
                w.state["switch_step"].fill_(w.step)
                w.state["phase"].fill_(True)
            grad = w.scratch.pop("grad", None)
            if grad is not None:
                w.param.grad = grad
