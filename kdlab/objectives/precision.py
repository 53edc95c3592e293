"""The precision of the exact computations: autocast off around every kernel (:func:`full_precision`), TF32
off where a result must be full fp32 (:func:`ieee_fp32`), TF32 on for the models' own products in a CUDA fit
(:func:`use_float32_matmul_precision`), and the smallest KL temperature fp32 resolves (:data:`TEMPERATURE_FLOOR`).

A CUDA fit runs with TF32 on (``torch.set_float32_matmul_precision("high")``, set by
:class:`~kdlab.stages.base.TaskStage`), which is right for the models' own products; the KL kernels' row-wise
dot products (:func:`~kdlab.objectives.kernels.rowdot`) are differences of cross-entropies and run under
:func:`ieee_fp32` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """A context in which fp32 matrix products are full fp32 (``torch.get_float32_matmul_precision() ==
    "highest"``), restoring the caller's setting after. The stage turns TF32 on for a CUDA fit ("high"), where
    a batched product of fp32 rows keeps about 10 mantissa bits: the exact KLs, differences of cross-entropies
    of ``max|logit|`` size, would lose about ``1e-3 * max|logit|`` nats."""
    kept = torch.get_float32_matmul_precision()
    if kept == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(kept)


def full_precision(*sources: object) -> contextlib.ExitStack:
    """A context in which autocast is off on the devices of ``sources`` (tensors,
    :class:`~kdlab.objectives.lazy.LazyLogits`: anything with a ``torch.device``; anything else is ignored), so the kernels' matrix products, ``bmm``, ``mv`` and reductions run in
    the dtype the kernels chose (fp32) rather than the caller's autocast dtype. Entered around every
    kernel; nesting is harmless."""
    stack = contextlib.ExitStack()
    device_types = {source.device.type for source in sources if isinstance(getattr(source, "device", None), torch.device)}
    for device_type in sorted(device_types):
        if torch.amp.is_autocast_available(device_type):
            stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
    return stack


TEMPERATURE_FLOOR = 1e-4
"""The smallest KL temperature accepted (:func:`check_kl_temperature`). Logits divided by less grow past what
fp32's exact KLs resolve: far below it a forward KL reads nothing like fp64's; at the floor both KLs are within 1e-5 of fp64 (relative). Both are
``tests/test_module.py::test_the_smallest_kl_temperature_accepted_keeps_the_kl_within_1e_5_of_fp64``."""


def check_kl_temperature(owner: str, name: str, value: float) -> None:
    """Refuse a temperature the KL is computed at that is not finite and at least :data:`TEMPERATURE_FLOOR`,
    naming ``<owner>.<name>``."""
    if not (value >= TEMPERATURE_FLOOR and value < float("inf")):
        raise ValueError(f"{owner}.{name} must be a finite number >= {TEMPERATURE_FLOOR} (smaller ones divide the logits past what the "
                         f"fp32 KLs resolve; for a near-greedy model use {TEMPERATURE_FLOOR} or more), got {value}")


def use_float32_matmul_precision(device: torch.device, precision: str | None = "high") -> None:
    """``torch.set_float32_matmul_precision(precision)`` when ``device`` is CUDA, ``precision`` is given and
    torch's setting is still its default ("highest"); else nothing."""
    if precision is not None and torch.device(device).type == "cuda" and torch.get_float32_matmul_precision() == "highest":
        torch.set_float32_matmul_precision(precision)
