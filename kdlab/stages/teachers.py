"""Where a ``DistillModule``'s teacher outputs come from when it is not one in-process model with the
student's vocabulary: the checks for a teacher with another tokenizer (``cross_tokenizer``) and for a teacher
served over HTTP (``served_teacher``), and the served teacher's rollouts (sampled or scored by the server)."""

from __future__ import annotations

from typing import Any

from kdlab.rollouts.policies import (
    CROSS_TOKENIZER_MIXTURE,
    CachedTeacherRollouts,
    MixtureRollouts,
    RolloutPolicy,
    TeacherRollouts,
)
from kdlab.rollouts.served import tempered_topk
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


def served_rollout(module: Any, prompts: Any, policy: RolloutPolicy, seed: int) -> Any:
    """``module``'s rollout with a ``served_teacher``: the server samples ``TeacherRollouts`` (each prompt seeded by ``seed`` and
    its row); other policies write as usual; then the server scores every completion and its tempered
    top-K log-probs become ``rollout.teacher_logprobs`` (:class:`~kdlab.rollouts.teacher_cache.TopKLogprobs`)."""
    from kdlab.data import Rollout, right_pad
    from kdlab.rollouts.teacher_cache import TopKLogprobs

    served = module.served_teacher
    teacher_prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.teacher_ids, prompts.teacher_mask)]
    if type(policy) is TeacherRollouts:
        rows = served.concurrently(lambda item: served.sample(item[1], module.max_completion_tokens, module.teacher_temperature, seed + item[0],
                                                        list(module.teacher_end_ids)), list(enumerate(teacher_prompts)))
        ids, mask = right_pad([row[: module.max_completion_tokens] for row in rows], module.pad_id)
        rollout = Rollout(prompts, ids.to(module.device), mask.to(module.device))
    else:
        rollout = policy.sample(prompts, module.rollout_context(module._generator(seed)))
    completions = [ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    scored = served.concurrently(lambda item: served.prompt_logprobs(item[0] + item[1], len(item[0])), list(zip(teacher_prompts, completions)))
    k = scored[0][0].shape[1] if scored else max(served.top_k, 1)
    topk = [tempered_topk(ids, raw, module.teacher_temperature, module.teacher_columns) for ids, raw in scored]
    rollout.teacher_logprobs = TopKLogprobs.from_rows(topk, rollout.completion_ids.shape[1], k, module.teacher_columns).to(module.device)
    return rollout
