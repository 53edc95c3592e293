"""Who writes the completions a stage trains on (``RolloutPolicy``), and the engines that write them.

* :mod:`kdlab.rollouts.policies`: ``TeacherRollouts`` (the teacher sampling online),
  ``TeacherDatasetRollouts`` (OffPD: a fixed file of teacher completions), ``CachedTeacherRollouts`` (that
  file with the teacher's top-k log-probs cached), ``StudentRollouts`` (OnPD), ``MixtureRollouts`` (a
  token-level mixture), and importance weights for off-policy samples;
* :mod:`kdlab.rollouts.decoding`: the Hugging Face decoding engine (KV-cached sampling, stop strings);
* :mod:`kdlab.rollouts.vllm`: ``VLLMRollouts``, the same policies sampled by vLLM (imported on use);
* :mod:`kdlab.rollouts.served_sampler`: ``ServedRollouts``, the student sampled by a vLLM-compatible server from
  pushed weights (:mod:`kdlab.rollouts.engines`); :mod:`kdlab.rollouts.overlap`: ``OverlappedRollouts``, such an
  engine writing the next steps' completions while this one trains;
* :mod:`kdlab.rollouts.teacher_data`: ``kdlab generate`` (teacher completions written once) and the
  top-k teacher cache builder; :mod:`kdlab.rollouts.teacher_cache`: the cache reader and writer;
  :mod:`kdlab.rollouts.cache_codec`: its compact format.
"""

from kdlab.rollouts.mixture import MixtureRollouts, mixture_logprobs
from kdlab.rollouts.policies import (
    CachedTeacherRollouts,
    RolloutContext,
    RolloutPolicy,
    StudentRollouts,
    TeacherDatasetRollouts,
    TeacherRollouts,
)
from kdlab.rollouts.overlap import OverlappedRollouts
from kdlab.rollouts.served_sampler import ServedRollouts
from kdlab.rollouts.vllm import VLLMRollouts

__all__ = [
    "RolloutPolicy", "RolloutContext", "TeacherRollouts", "TeacherDatasetRollouts", "CachedTeacherRollouts",
    "StudentRollouts", "MixtureRollouts", "VLLMRollouts", "ServedRollouts", "OverlappedRollouts", "mixture_logprobs",
]


def __getattr__(name: str):
    """kdlab 0.1's names of this module path that moved (:data:`kdlab._legacy.MOVED`), with a FutureWarning."""
    from kdlab._legacy import moved_attribute

    return moved_attribute(__name__, name)
