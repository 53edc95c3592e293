"""The paper's token-level rollout spectrum pi_lambda between teacher and student: its distribution
(:func:`mixture_logprobs`) and the policy that samples from it (:class:`MixtureRollouts`), beside the other rollout
policies of :mod:`kdlab.rollouts.policies`."""

from __future__ import annotations

import math

import torch

from kdlab.data import PromptBatch, Rollout
from kdlab.rollouts.policies import RolloutContext, RolloutPolicy


def mixture_logprobs(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    lam: float,
    alpha: float = 0.2,
    clip: float = 2 * math.log(3),
) -> torch.Tensor:
    """Normalised log pi_lambda ``(..., V)`` from normalised student/teacher log-probs ``s``, ``t``.

    With r = s - t:

    * -1 <= lam <= 1: log-space interpolation ``z = (1+lam)/2 s + (1-lam)/2 t`` (lam = -1 is the
      teacher, 1 the student, 0 the normalised geometric mean);
    * lam > 1: ``z = s + (lam-1)/2 * M_S * clamp(r, 0, clip)``, amplifying tokens the student prefers
      more than the teacher, only inside the student's plausible set
      ``M_S = {v : s(v) >= max s + log alpha}``; other tokens keep their anchor score s;
    * lam < -1: the mirror image, anchored on t with ``M_T * clamp(-r, 0, clip)``.

    The endpoints lam = -1 and lam = 1 return ``t`` and ``s`` themselves, so mixture sampling there is
    exactly teacher or student sampling.
    """
    validate_mixture(lam, alpha, clip)
    s, t = student_logprobs, teacher_logprobs
    if lam == 1:
        return s
    if lam == -1:
        return t
    if -1 < lam < 1:
        z = (1 + lam) / 2 * s + (1 - lam) / 2 * t  # both weights are > 0 here, so -inf stays -inf
    elif lam > 1:
        z = s + (lam - 1) / 2 * _bonus(s, s - t, alpha, clip)
    else:
        z = t + (-lam - 1) / 2 * _bonus(t, t - s, alpha, clip)
    return torch.log_softmax(z, dim=-1)


def _bonus(anchor: torch.Tensor, advantage: torch.Tensor, alpha: float, clip: float) -> torch.Tensor:
    """``M * min(max(advantage, 0), clip)`` with ``M`` the anchor's plausible set; 0 outside it."""
    plausible = anchor >= anchor.max(dim=-1, keepdim=True).values + math.log(alpha)
    return torch.where(plausible, advantage.nan_to_num(nan=0.0).clamp(min=0.0, max=clip), 0.0)


def validate_mixture(lam: float, alpha: float, clip: float) -> None:
    if not -2.0 <= lam <= 2.0:
        raise ValueError(f"MixtureRollouts.lam must be in [-2, 2], got {lam}")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"MixtureRollouts.alpha must be in (0, 1], got {alpha}")
    if not clip > 0.0:
        raise ValueError(f"MixtureRollouts.clip must be > 0, got {clip}")


CROSS_TOKENIZER_MIXTURE = (
    "MixtureRollouts mixes the two models' next-token distributions token by token, which needs one shared "
    "vocabulary; across tokenizers use TeacherRollouts / TeacherDatasetRollouts / CachedTeacherRollouts "
    "(off-policy) or StudentRollouts (on-policy)"
)


class MixtureRollouts(RolloutPolicy):
    """The token-level rollout spectrum pi_lambda (see :func:`mixture_logprobs`).

    Both models decode together, each with its own prompt and KV cache, at their own temperatures;
    at every step the next token is drawn from pi_lambda of their tempered distributions. At
    lam = -1 or 1 only the model that matters is run, which gives exactly teacher or student sampling.

    Args:
        lam: position on the spectrum in [-2, 2]: -1 teacher (OffPD), 1 student (OnPD).
        alpha: plausibility threshold of the amplified regimes (|lam| > 1), in (0, 1].
        clip: cap on the log-ratio bonus (> 0); 2 ln 3 caps amplification at x3.
    """

    def __init__(self, lam: float = 0.0, alpha: float = 0.2, clip: float = 2 * math.log(3)) -> None:
        super().__init__()
        validate_mixture(lam, alpha, clip)
        self.lam, self.alpha, self.clip = float(lam), float(alpha), float(clip)

    def needs(self) -> frozenset[str]:
        return frozenset({"teacher_decodes", "teacher_scores", "one_vocabulary"})

    def next_token_logprobs(self, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        return mixture_logprobs(student_logprobs, teacher_logprobs, self.lam, self.alpha, self.clip)

    def sample(self, prompts: PromptBatch, context: RolloutContext) -> Rollout:
        if context.teacher_tokens is not None:
            raise ValueError(CROSS_TOKENIZER_MIXTURE)
        if self.lam == 1:
            return context.sample(context.decoder("student", prompts), prompts)
        if self.lam == -1:
            return context.sample(context.decoder("teacher", prompts), prompts, writer="teacher")
        student, teacher = context.decoder("student", prompts), context.decoder("teacher", prompts)

        def next_logprobs(previous: torch.Tensor | None) -> torch.Tensor:
            return mixture_logprobs(student(previous), teacher(previous), self.lam, self.alpha, self.clip)

        return context.sample(next_logprobs, prompts)
