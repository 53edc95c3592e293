"""Optimisation pieces shared by kdlab's modules: an AdamW that never steps on non-finite gradients,
and the learning-rate schedules (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math
import numbers

import torch

SCHEDULES = ("cosine", "constant")


def check_adamw(owner: str, lr: float, betas: tuple[float, float] | list[float], eps: float, weight_decay: float) -> None:
    """Refuse AdamW settings torch would refuse later (in ``configure_optimizers``, in its own words), naming
    ``<owner>.<key>``: ``lr > 0``, two ``betas`` in [0, 1), ``eps >= 0``, ``weight_decay >= 0``."""
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"{owner}.lr must be a finite number > 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"{owner}.betas must be two numbers in [0, 1), got {list(betas)}")
    if not eps >= 0:
        raise ValueError(f"{owner}.eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"{owner}.weight_decay must be >= 0, got {weight_decay}")


def check_schedule(owner: str, warmup_steps: int, schedule: str = "constant", min_lr_ratio: float = 0.0) -> None:
    """Refuse learning-rate schedule settings (:func:`lr_multiplier`), naming ``<owner>.<key>``: ``warmup_steps`` an
    integer >= 0, ``schedule`` one of :data:`SCHEDULES`, ``min_lr_ratio`` in [0, 1] (a negative floor would end the
    cosine at a negative learning rate: gradient ascent)."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
        raise ValueError(f"{owner}.warmup_steps must be an integer >= 0, got {warmup_steps}")
    if schedule not in SCHEDULES:
        raise ValueError(f"{owner}.schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"{owner}.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


class FiniteAdamW(torch.optim.AdamW):
    """AdamW that skips a step whose gradients hold NaN or inf.

    The closure (forward, backward, clipping) runs as usual; if any gradient is then non-finite, the
    gradients are zeroed and neither the parameters nor the moment estimates change. ``skipped`` counts
    skipped steps, ``last_skipped`` says whether the latest call skipped.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.skipped = 0
        self.last_skipped = False

    def gradients_finite(self) -> bool:
        """Whether every gradient entry is finite, on every rank (sharded gradients are checked shard by
        shard and the decision is reduced, so all ranks skip or step together)."""
        params = [p for group in self.param_groups for p in group["params"]]
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        device = params[0].device if params else torch.device("cpu")
        # one stacked reduction and a single host sync, not one per tensor
        finite = torch.stack([torch.isfinite(g).all() for g in local]).all().int() if local else torch.ones((), dtype=torch.int32, device=device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        return bool(finite.item())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_skipped = not self.gradients_finite()
        if self.last_skipped:
            self.skipped += 1
            self.zero_grad(set_to_none=True)
            return loss
        return super().step()


def lr_multiplier(warmup_steps: int, total_steps: int | None = None, cosine: bool = False, floor: float = 0.0):
    """``LambdaLR`` factor: step k (0-based) gets ``(k + 1) / warmup_steps`` during warm-up, then 1
    (constant) or a cosine decay from 1 to ``floor`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, (total_steps or 1) - warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
