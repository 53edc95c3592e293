"""Token-level objectives (``KLObjective``) and the kernels they run on.

* :mod:`kdlab.objectives.kl`: the objectives a config chooses (``ForwardKL``, ``ReverseKL``,
  ``SampledForwardKL``, ...), their per-token maths and diagnostics;
* :mod:`kdlab.objectives.reduction`: the reduction over completion tokens and the one chunked pass behind every objective;
* :mod:`kdlab.objectives.kernels`: the chunked, fused-head KL kernels they share;
* :mod:`kdlab.objectives.aligned`: the same objectives across tokenizers (``CrossTokenizer``);
* :mod:`kdlab.objectives.logits`: the student's and teacher's completion logits (full or lazy head);
* :mod:`kdlab.objectives.logprobs`: chunked token log-probabilities (GRPO's policy term).
"""

from kdlab.objectives.aligned import CrossTokenizer
from kdlab.objectives.lazy import HeadLogits, LazyLogits, Logits
from kdlab.objectives.kl import (
    ForwardKL,
    GeneralizedJSD,
    KLObjective,
    ReverseKL,
    SampledForwardKL,
    SampledReverseKL,
    TotalVariation,
)

__all__ = ["KLObjective", "ForwardKL", "ReverseKL", "GeneralizedJSD", "TotalVariation", "SampledForwardKL", "SampledReverseKL", "CrossTokenizer", "HeadLogits", "LazyLogits", "Logits"]


def __getattr__(name: str):
    """kdlab 0.1's names of this module path that moved (:data:`kdlab._legacy.MOVED`), with a FutureWarning."""
    from kdlab._legacy import moved_attribute

    return moved_attribute(__name__, name)
