"""``TeacherSource``: where a distillation run's teacher distribution comes from, and what it can do.

Every source answers the same calls, so :class:`~kdlab.stages.distill.DistillModule` holds one ``teacher`` and
never asks which kind it holds:

* :meth:`TeacherSource.bind`, before any weights load: its tokenizer, its logit columns (checked against the
  student's vocabulary unless the run distils across tokenizers) and every check that needs no weights;
* :meth:`TeacherSource.load`: its weights, if it has any in this process (held frozen by the stage);
* :meth:`TeacherSource.completion_logprobs`: its tempered distribution on a rollout's completions, ``(B, C, V)``
  as a tensor, a :class:`~kdlab.objectives.lazy.HeadLogits` or a
  :class:`~kdlab.rollouts.teacher_cache.TopKLogprobs` (the three shapes every objective takes);
* :meth:`TeacherSource.write`: teacher-written completions (token by token in this process, or sampled by a
  server), for sources that :data:`WRITES`;
* :meth:`TeacherSource.decoder`: next-token log-probs in this process, for sources that :data:`DECODES`
  (token-level mixtures need them);
* :meth:`TeacherSource.texts`: completion texts for the evaluating callbacks (the teacher's share of Spanish...).

What a source can do is :meth:`TeacherSource.offers`, a set of the capability names below; a rollout policy
declares what it needs (:meth:`kdlab.rollouts.policies.RolloutPolicy.needs`) and :func:`check_needs` compares the
two before any weight loads, naming the settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kdlab.components import Component

DECODES = "teacher_decodes"
"""Next-token log-probs in this process, step by step (mixing with the student token by token)."""
WRITES = "teacher_writes"
"""Writes whole completions (in this process, or sampled by a server)."""
WEIGHTS = "teacher_weights"
"""A model path an engine can load itself (vLLM rollouts from the teacher)."""
SCORES = "teacher_scores"
"""Scores any completion (a cache scores only the completions of the dataset it was computed on)."""
ONE_VOCABULARY = "one_vocabulary"
"""The student and the teacher share one vocabulary (no ``cross_tokenizer``)."""

CAPABILITIES = {
    DECODES: "a teacher that decodes token by token in this process (an in-process model, the student's base, or "
             "several such teachers)",
    WRITES: "a teacher that writes completions (an in-process model, the student's base, or a served teacher that samples)",
    WEIGHTS: "a teacher model path that an engine loads itself (an in-process teacher's {path: ...})",
    SCORES: "a teacher that scores any completion (not a cache, which holds only its dataset's completions)",
    ONE_VOCABULARY: "one vocabulary shared by student and teacher (no cross_tokenizer)",
}


@dataclass
class TeacherRun:
    """What a source needs to know of the run it serves (built by the stage before any weights load).

    Attributes:
        student_tokenizer, student_config: the student's (its vocabulary is the reference without ``cross_tokenizer``).
        student_columns: the student's logit columns (``len`` of its tokenizer, checked against its head).
        teacher_temperature: pi_T = softmax(z_T / teacher_temperature).
        cross_tokenizer: the run distils across tokenizers (each model reads completions in its own tokens).
        placement: ``replicate`` or ``shard`` (FSDP): where an in-process teacher's weights live.
        fused_lm_head: ``DistillModule.fused_lm_head`` (``None``: wherever valid).
        reduction, chunk_size: the objective's, for diagnostics a source computes itself (several teachers).
        stop_strings: rollouts stop once a completion contains one of these.
        max_completion_tokens: the rollout length budget.
        layout: how an in-process model reads a micro-batch (:class:`~kdlab.rollouts.packing.RowLayout`: padded rows
            or packed ones), the student's layout, so the teacher's outputs sit on the same tokens; ``None``: padded.
    """

    student_tokenizer: Any
    student_config: Any
    student_columns: int
    teacher_temperature: float
    cross_tokenizer: bool = False
    placement: str = "replicate"
    fused_lm_head: bool | None = None
    reduction: str = "token"
    chunk_size: int | None = None
    stop_strings: tuple[str, ...] = ()
    max_completion_tokens: int = 512
    held: dict[str, torch.nn.Module] = field(default_factory=dict)
    """The stage's frozen models by name (``TaskStage._frozen``): sources read their models from it, since the stage
    may replace an entry by its sharded wrapper."""
    student: Callable[[], torch.nn.Module] | None = None
    """Returns the (loaded) student as the stage holds it at the time of the call (under FSDP1 the stage replaces it by
    an FSDP root around it), for the source that is the student's own base: call it each time, do not keep its result."""
    layout: Any = None


def hold(run: TeacherRun, name: str, model: torch.nn.Module) -> torch.nn.Module:
    """Keep ``model`` frozen, in eval mode, in ``run.held`` under ``name`` (out of the stage's state) and return it."""
    model.requires_grad_(False).eval()
    run.held[name] = model
    return model


class TeacherSource(Component):
    """Base class of the teacher's sources (see the module docstring). After :meth:`bind`, ``tokenizer``,
    ``token_columns`` (its logit columns) are set; after :meth:`load`, ``end_ids`` (the tokens that end its
    completions)."""

    spec: Any = None
    """A model path an engine may load itself (:class:`~kdlab.models.loading.ModelSpec`), for sources that have one."""
    tokenizer: Any = None
    token_columns: int = 0
    end_ids: tuple[int, ...] = ()
    setting: str = "DistillModule.teacher"

    # ---- before any weights ---------------------------------------------------------------------------
    def bind(self, run: TeacherRun, setting: str = "DistillModule.teacher") -> None:
        """Load the tokenizer, set ``token_columns`` and run every check that needs no weights; errors name
        ``setting``."""
        raise NotImplementedError

    def offers(self, run: TeacherRun) -> frozenset[str]:
        """What this source can do in ``run`` (capability names of this module); known before :meth:`bind`, so a
        rollout policy's needs are checked before any file is read."""
        return frozenset({ONE_VOCABULARY} if not run.cross_tokenizer else ())

    @property
    def run(self) -> TeacherRun:
        if getattr(self, "_run", None) is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a run yet (TeacherSource.bind)")
        return self._run

    def model_specs(self) -> list[Any]:
        """The models this source holds in training memory."""
        return []

    @classmethod
    def config_models(cls, init_args: dict[str, Any], visit: Callable[[Any], tuple[list[Any], bool]]) -> tuple[list[Any], bool]:
        """What ``kdlab estimate`` counts of this source from its config's ``init_args``, before anything is built: the
        model settings it would hold in training memory, and whether a top-k cache stands for a teacher. ``visit``
        reads a nested teacher value (a member of several) the same way. Default: nothing in memory."""
        return [], False

    # ---- weights --------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load what sits in this process (nothing by default) and set ``end_ids``."""
        self.end_ids = tokenizer_end_ids(self.tokenizer)

    def models(self) -> dict[str, torch.nn.Module]:
        """The frozen in-process models, by the name the stage holds them under (sharding, placement)."""
        return {}

    @property
    def model(self) -> torch.nn.Module:
        """The in-process teacher model; an error for a source without one."""
        raise RuntimeError(f"this run's teacher ({type(self).__name__}) has no model in this process: its outputs come from "
                           "a teacher cache, a served teacher or several teachers")

    def ready(self) -> None:
        """Checks that need the outside world, at the start of fit (a served teacher asks its server)."""

    # ---- per step -------------------------------------------------------------------------------------
    def rollout(self, policy: Any, prompts: Any, context: Any) -> Any:
        """The rollout of ``prompts`` by ``policy`` (by default, what the policy samples; a source may attach its
        signal here, e.g. a served teacher scores the whole decode group in one go)."""
        return policy.sample(prompts, context)

    def completion_logprobs(self, rollout: Any, student: Any = None) -> Any:
        """The tempered teacher ``(B, C, V)`` on ``rollout``'s completions (in the teacher's tokens across
        tokenizers): a tensor of logits or log-probs, a ``HeadLogits`` or a ``TopKLogprobs``, no grad.
        ``student``: the student's ``(B, C, V)`` (for sources that log per-teacher diagnostics)."""
        raise NotImplementedError

    def rows_logprobs(self, rollout: Any, rows: torch.Tensor) -> Any:
        """Its tempered distribution on rows ``rows`` of ``rollout`` (as one of several teachers): ``(len(rows), C, V)``
        logits or log-probs, or a list of top-k ``(ids, log-probs)`` per row."""
        raise NotImplementedError(f"{type(self).__name__} cannot be one of several teachers")

    def decoder(self, prompts: Any, temperature: float) -> Callable[[torch.Tensor | None], torch.Tensor]:
        """Next-token log-probs ``(B, V)`` on ``prompts``' teacher prompts, step by step (sources that :data:`DECODES`)."""
        raise NotImplementedError(f"{type(self).__name__} does not decode in this process")

    def write(self, prompts: Any, context: Any) -> Any:
        """Teacher-written completions of ``prompts`` (a :class:`~kdlab.data.Rollout`): by default sampled token by
        token from :meth:`decoder` at the teacher's temperature."""
        return context.sample(self.decoder(prompts, context.teacher_temperature), prompts, writer="teacher")

    def prefetch(self, policy: Any, prompts: Callable[[], Any], seed: int, context: Callable[[], Any]) -> None:
        """Start the next decode group's teacher work in the background when it does not depend on the student
        (no-op by default). ``prompts``/``context`` build that group's prompt batch and rollout context."""

    def named_diagnostics(self, diagnostics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-teacher diagnostics to log beside the step's (several teachers: ``kl_forward/<name>``)."""
        return {}

    def texts(self, task: Any, examples: list[Any], device: torch.device, **settings: Any) -> list[str]:
        """Completion texts of ``examples`` prompted as the teacher (:func:`kdlab.evaluation.scoring.completion_texts`'s
        settings), for the evaluating callbacks."""
        raise NotImplementedError(f"{type(self).__name__} cannot write evaluation completions")


def tokenizer_end_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """The tokens that end a teacher's completions when no model is loaded: the tokenizer's EOS, then the
    ``eos_token_id`` of the generation config next to the tokenizer (or ``generation_config``) when there is one."""
    from kdlab.models.loading import end_token_ids

    if generation_config is None:
        generation_config = folder_generation_config(getattr(tokenizer, "name_or_path", None))

    class _Carrier:  # end_token_ids reads model.generation_config
        pass

    carrier = _Carrier()
    carrier.generation_config = generation_config
    return end_token_ids(tokenizer, carrier)


def folder_generation_config(path: str | None) -> Any:
    """The ``generation_config.json`` of a local model folder, or ``None``."""
    from pathlib import Path

    if not path or not (Path(path) / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(path)


def check_needs(needs: frozenset[str], offers: frozenset[str], policy: str, source: str) -> None:
    """Refuse a rollout policy whose needs the teacher source does not offer, naming both settings and what is missing."""
    from kdlab.errors import ConfigError

    missing = sorted(needs - offers)
    if missing:
        wanted = "; ".join(CAPABILITIES.get(name, name) for name in missing)
        raise ConfigError(f"DistillModule.rollout: {policy} needs {wanted}, which DistillModule.teacher ({source}) does not offer")
