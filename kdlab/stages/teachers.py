"""Where a ``DistillModule``'s teacher outputs come from when it is not one in-process model with the
student's vocabulary: the checks for a teacher with another tokenizer (``cross_tokenizer``) and for a teacher
served over HTTP (``served_teacher``), and the served teacher's rollouts (sampled or scored by the server)."""

from __future__ import annotations

from typing import Any

import torch

from kdlab.rollouts.policies import (
    CROSS_TOKENIZER_MIXTURE,
    CachedTeacherRollouts,
    MixtureRollouts,
    RolloutPolicy,
    TeacherRollouts,
)
from kdlab.tasks.base import Task


def vocabulary_columns(tokenizer: Any, config: Any, role: str) -> int:
    """``len(tokenizer)``: the logit columns of one model (its head may have padding rows), checked
    against the head's rows."""
    from kdlab.models.loading import output_rows

    columns = len(tokenizer)
    if output_rows(config) < columns:
        raise ValueError(f"{role} has {output_rows(config)} output rows, fewer than the tokenizer's {columns} tokens")
    return columns


def check_cross_tokenizer_run(task: Task, rollout: RolloutPolicy, student_tokenizer: Any, teacher_tokenizer: Any, probes: int = 8) -> None:
    """Before any weight loads: refuse what needs one vocabulary (``MixtureRollouts``, vLLM rollouts),
    and tokenizers that do not reproduce the task's text byte for byte
    (:func:`kdlab.alignment.check_reproduces` names the model and the first differing character)."""
    from kdlab.alignment import check_reproduces
    from kdlab.errors import ConfigError

    if isinstance(rollout, MixtureRollouts):
        raise ConfigError(f"DistillModule.rollout: {CROSS_TOKENIZER_MIXTURE}")
    if type(rollout).__name__ == "VLLMRollouts":
        raise ConfigError(
            "DistillModule.rollout: VLLMRollouts is not supported with cross_tokenizer yet (its engine returns one "
            "vocabulary's token ids); use TeacherRollouts or StudentRollouts (Hugging Face decoding)"
        )
    texts: list[str] = []
    for split in ("train", "val"):
        for example in list(task.examples(split))[:probes]:
            texts += [message["content"] for message in task.student_messages(example) + task.teacher_messages(example)]
            reference = task.reference_completion(example)
            if reference:
                texts.append(reference)
        if texts:
            break
    for text in dict.fromkeys(texts):
        for role, tokenizer in (("student", student_tokenizer), ("teacher", teacher_tokenizer)):
            try:
                check_reproduces(tokenizer, text, tokenizer(text, add_special_tokens=False)["input_ids"], f"DistillModule.{role}'s")
            except ConfigError as error:
                raise ConfigError(f"{error} (in {text[:60]!r}; cross_tokenizer aligns the two models' tokens by bytes)") from None


def check_served_teacher_run(teacher: Any, rollout: RolloutPolicy, cross_tokenizer: Any, base_teacher: bool) -> None:
    """``served_teacher`` stands for the teacher model: refuse what needs the model itself or a second teacher."""
    from kdlab.errors import ConfigError

    if teacher is not None or base_teacher:
        raise ConfigError("DistillModule.served_teacher is the teacher: set teacher: null (and base_teacher: false); "
                          "ServedTeacher.tokenizer gives its tokenizer")
    if cross_tokenizer is not None:
        raise ConfigError("DistillModule.served_teacher does not support cross_tokenizer yet: serve a teacher with the student's tokenizer")
    if isinstance(rollout, (MixtureRollouts, CachedTeacherRollouts)) or type(rollout).__name__ == "VLLMRollouts":
        raise ConfigError(
            f"DistillModule.rollout: {type(rollout).__name__} needs the teacher model in this process (or its own cache); with "
            "served_teacher use TeacherRollouts (sampled by the server), StudentRollouts or TeacherDatasetRollouts (scored by it)"
        )


class ServedWork:
    """A served rollout on its way: the examples, policy and seed it is for, their prompts, the completions when
    this process wrote them (``None``: the server samples them), and the server's part (``work``: samples, then
    every completion's tempered top-K), run now or in the prefetch thread (``future``)."""

    def __init__(self, prompts: Any, policy: RolloutPolicy, seed: int, settings: tuple, rollout: Any, work: Any) -> None:
        self.examples, self.policy, self.seed, self.settings = list(prompts.examples), policy, seed, settings
        self.prompts, self.rollout, self.work, self.future = prompts, rollout, work, None

    def matches(self, prompts: Any, policy: RolloutPolicy, seed: int, settings: tuple) -> bool:
        return policy is self.policy and seed == self.seed and settings == self.settings and list(prompts.examples) == self.examples

    def result(self) -> tuple[list[list[int]], list[Any]]:
        return self.future.result() if self.future is not None else self.work()


def start_served(module: Any, prompts: Any, policy: RolloutPolicy, seed: int) -> ServedWork:
    """The served rollout of ``prompts``, up to the server's part: ``TeacherRollouts`` are left to the server
    (each prompt seeded by ``seed`` and its row); other policies write here, as without a served teacher."""
    served, temperature, columns = module.served_teacher, module.teacher_temperature, module.teacher_columns
    length, ends = module.max_completion_tokens, list(module.teacher_end_ids)
    teacher_prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.teacher_ids, prompts.teacher_mask)]
    rollout = completions = None
    if type(policy) is not TeacherRollouts:
        rollout = policy.sample(prompts, module.rollout_context(module._generator(seed)))
        completions = [ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]

    def work() -> tuple[list[list[int]], list[Any]]:
        written = completions
        if written is None:
            written = served.concurrently(lambda item: served.sample(item[1], length, temperature, seed + item[0], ends)[:length],
                                          list(enumerate(teacher_prompts)))
        return written, served.score(teacher_prompts, written, temperature, columns)

    return ServedWork(prompts, policy, seed, served_settings(module), rollout, work)


def served_settings(module: Any) -> tuple:
    """What a served rollout depends on besides its examples, policy and seed."""
    return (module.served_teacher, module.teacher_temperature, module.max_completion_tokens, tuple(module.teacher_end_ids), module.pad_id)


def served_rollout(module: Any, prompts: Any, policy: RolloutPolicy, seed: int) -> Any:
    """``module``'s rollout with a ``served_teacher`` (:func:`start_served`, or the work :func:`prefetch_served`
    started for these examples, policy and seed); the server's tempered top-K log-probs on every completion
    become ``rollout.teacher_logprobs`` (:class:`~kdlab.rollouts.teacher_cache.TopKLogprobs`)."""
    from kdlab.data import Rollout, right_pad
    from kdlab.rollouts.teacher_cache import TopKLogprobs

    ahead = getattr(module, "_served_ahead", None)
    if ahead is not None and ahead.matches(prompts, policy, seed, served_settings(module)):
        module._served_ahead, pending = None, ahead
    else:  # nothing prefetched for these (a prefetch for other examples stays for its own step)
        pending = start_served(module, prompts, policy, seed)
    completions, scored = pending.result()
    rollout = pending.rollout
    if rollout is None:
        ids, mask = right_pad(completions, module.pad_id)
        rollout = Rollout(pending.prompts, ids.to(module.device), mask.to(module.device))
    k = max((ids.shape[1] for ids, _ in scored), default=max(module.served_teacher.top_k, 1))
    rollout.teacher_logprobs = TopKLogprobs.from_rows(scored, rollout.completion_ids.shape[1], k, module.teacher_columns).to(module.device)
    return rollout


def prefetch_served(module: Any, examples: list[Any], seed: int) -> None:
    """Start the served rollout of ``examples`` (the next decode group, at its own ``seed``) in the background,
    when ``served_teacher.prefetch`` is on and the rollout does not depend on the student: teacher-written
    completions (``TeacherRollouts``, sampled by the server, or a teacher dataset). :func:`served_rollout`
    takes it when it is asked for those examples, policy and seed; anything else computes afresh."""
    policy = module.rollout
    if not module.served_teacher.prefetch or not isinstance(policy, TeacherRollouts) or isinstance(policy, CachedTeacherRollouts):
        return
    try:
        with torch.no_grad():
            pending = start_served(module, module._prompts(examples), policy, seed)
    except Exception:  # noqa: BLE001 - the step that needs these examples meets the error itself
        return
    pending.future = module.served_teacher.in_background(pending.work)
    module._served_ahead = pending
