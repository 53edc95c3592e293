"""How several teachers make the teacher of each example (:class:`TeacherChoice`): route it to one
(:class:`ByField`) or average them (:class:`Average`), and :func:`combine`, the combined distribution of the
module docstring of :mod:`kdlab.teachers.several`."""

from __future__ import annotations

import math

import torch

from kdlab.components import Component
from kdlab.errors import ConfigError
from kdlab.objectives.lazy import LazyLogits
from kdlab.tasks.base import Example


class TeacherChoice(Component):
    """How a run's named teachers make the teacher of each example: :meth:`weights` ``(B, n)`` (rows sum to
    1, in ``names`` order) and ``over`` (``probs`` or ``logprobs``, see the module docstring)."""

    over: str = "probs"
    one_teacher_per_example: bool = False
    """Whether each example gets exactly one teacher (so ranks holding different examples call different teachers)."""

    def check(self, names: list[str]) -> None:
        """Raise naming the setting when the choice refers to a teacher not in ``names``."""

    def weights(self, examples: list[Example], names: list[str]) -> torch.Tensor:
        raise NotImplementedError


class ByField(TeacherChoice):
    """Route each example to one teacher by a field: ``routes[example[field]]`` (``default`` for values not in
    ``routes``; without one such an example is an error naming it).

    Args:
        routes: field value -> teacher name, e.g. ``{countdown: strong, addition: skills}``.
        field: the example field read (``MultiTask`` writes its task names to ``task``).
        default: the teacher of every other value (``None``: none).
    """

    one_teacher_per_example = True

    def __init__(self, routes: dict[str, str], field: str = "task", default: str | None = None) -> None:
        super().__init__()
        self.routes, self.field, self.default = dict(routes), field, default

    def check(self, names: list[str]) -> None:
        for value, name in [*self.routes.items(), *([("default", self.default)] if self.default is not None else [])]:
            if name not in names:
                raise ConfigError(f"ByField.routes.{value}: {name!r} is not one of DistillModule.teachers {names}")

    def weights(self, examples: list[Example], names: list[str]) -> torch.Tensor:
        weights = torch.zeros(len(examples), len(names))
        for row, example in enumerate(examples):
            name = self.routes.get(str(example.get(self.field)), self.default)
            if name is None:
                raise KeyError(f"ByField: example {example.get('id')!r} has {self.field}={example.get(self.field)!r}, which "
                               f"ByField.routes {sorted(self.routes)} does not route and there is no default")
            weights[row, names.index(name)] = 1.0
        return weights


class Average(TeacherChoice):
    """Every example gets every teacher, averaged with ``weights`` (normalised; ``None``: equal).

    Args:
        weights: teacher name -> weight (> 0; teachers left out get 0).
        over: ``probs`` (mixture) or ``logprobs`` (product of experts), see the module docstring.
    """

    def __init__(self, weights: dict[str, float] | None = None, over: str = "probs") -> None:
        super().__init__()
        if over not in ("probs", "logprobs"):
            raise ValueError(f"Average.over must be 'probs' or 'logprobs', got {over!r}")
        if weights is not None and (not weights or min(weights.values()) <= 0):
            raise ValueError(f"Average.weights must be positive, got {weights}")
        self.named, self.over = weights, over

    def check(self, names: list[str]) -> None:
        unknown = sorted(set(self.named or {}) - set(names))
        if unknown:
            raise ConfigError(f"Average.weights: {unknown} are not among DistillModule.teachers {names}")

    def weights(self, examples: list[Example], names: list[str]) -> torch.Tensor:
        row = torch.tensor([1.0 if self.named is None else float(self.named.get(name, 0.0)) for name in names])
        return (row / row.sum()).expand(len(examples), -1).clone()


class RowSubset(LazyLogits):
    """Rows ``index`` of a lazy ``(B, T, V)`` logits object, as a ``(len(index), T, V)`` one."""

    def __init__(self, base: LazyLogits, index: torch.Tensor) -> None:
        self.base, self.index = base, index.to(base.device)
        self.shape, self.dtype, self.device = torch.Size((len(index), *base.shape[1:])), base.dtype, base.device

    def rows(self, b: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.base.rows(self.index[b.to(self.device)], t, dtype)

    def detach(self) -> RowSubset:
        return RowSubset(self.base.detach(), self.index)


def combine(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], shape: tuple[int, ...], over: str) -> torch.Tensor:
    """The combined teacher's log-probs ``shape`` = ``(B, C, V)`` from ``parts``: ``(rows (B_i,), weights (B_i,),
    logits or log-probs (B_i, C, V))`` per teacher (see the module docstring; rows no teacher serves are uniform).
    When every row has one teacher (routing), each row is that teacher's normalised log-probs, with no averaging pass."""
    device = parts[0][2].device
    if all(bool((weights == 1).all()) for _, weights, _ in parts):  # routing: each row is its one teacher's, as it is
        routed = torch.full(shape, -math.log(shape[-1]), device=device)
        for rows, _, logits in parts:
            routed[rows] = torch.log_softmax(logits.float(), dim=-1)
        return routed
    total = torch.full(shape, -math.inf if over == "probs" else 0.0, device=device)
    for rows, weights, logits in parts:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if over == "probs":
            total[rows] = torch.logaddexp(total[rows], logprobs + weights.log().to(device)[:, None, None])
        else:
            total[rows] += weights.to(device)[:, None, None] * logprobs
    if over == "probs":
        total = torch.where(torch.isinf(total).all(-1, keepdim=True), torch.zeros_like(total), total)
    return torch.log_softmax(total, dim=-1)
