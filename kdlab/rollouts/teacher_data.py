"""``kdlab generate --config X.yaml``: sample teacher responses once, for off-policy distillation.

Writes a JSONL file with one ``{"id", "completion", "score", "ended"}`` object per kept sample
(``ended`` is false for a response cut by ``max_new_tokens``), which
:class:`kdlab.rollouts.policies.TeacherDatasetRollouts` reads as its ``dataset``. With ``verified_only`` only
responses the task's verifier accepts are kept (the paper kept verified demonstrations), so some
prompts may end up without a response; distillation then trains on the prompts that have one.
``engine: vllm`` samples with vLLM instead of kdlab's decoder (same prompts, end tokens and rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kdlab.models.loading import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.rollouts.decoding import sample_completions
from kdlab.rollouts.cache_codec import MAX_BITS, MIN_BITS
from kdlab.rollouts.teacher_cache import CACHE_FORMATS, prompt_digest, top_k_logprobs, write_cache
from kdlab.tasks.base import Task


@torch.no_grad()
def build_teacher_cache(
    teacher: torch.nn.Module, tokenizer: Any, task: Any, dataset: str, output: str, top_k: int, temperature: float,
    max_new_tokens: int, max_prompt_tokens: int, batch_size: int, teacher_name: str = "?", cache_format: str = "compact",
    logprob_bits: int | None = None,
) -> int:
    """Run ``teacher`` on each dataset completion (exactly the tokens ``TeacherDatasetRollouts`` will train on,
    after the teacher's own prompt) and write the top-k cache in ``cache_format`` (``compact``, ``logprob_bits``
    per log-prob, or ``full``: :func:`kdlab.rollouts.teacher_cache.write_cache`), each example with the digest of
    its teacher prompt (:func:`~kdlab.rollouts.teacher_cache.prompt_digest`), which a run reading the cache must
    give again; returns the number of examples cached."""
    from kdlab.data import encode_prompts
    from kdlab.models.loading import end_token_ids
    from kdlab.objectives.logits import completion_logits
    from kdlab.rollouts.policies import RolloutContext, TeacherDatasetRollouts

    policy = TeacherDatasetRollouts(dataset)
    examples = [example for example in task.examples("train") if policy.covers(example)]
    vocab = len(tokenizer)
    device = next(teacher.parameters()).device
    context = RolloutContext(
        student=teacher, teacher=teacher, tokenizer=tokenizer, token_columns=vocab, max_new_tokens=max_new_tokens,
        eos_token_ids=end_token_ids(tokenizer, teacher), pad_token_id=int(tokenizer.pad_token_id),
        student_temperature=1.0, teacher_temperature=temperature, generator=None,
    )
    teacher.eval()
    rows: dict[str, dict[str, torch.Tensor]] = {}
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        prompts = encode_prompts(task, batch, tokenizer, tokenizer, max_prompt_tokens, context.pad_token_id)
        for name in ("student_ids", "student_mask", "teacher_ids", "teacher_mask"):
            setattr(prompts, name, getattr(prompts, name).to(device))
        rollout = policy.sample(prompts, context)
        logits = completion_logits(teacher, rollout.model_inputs("teacher"), rollout.completion_ids.shape[1], vocab)
        indices, logprobs = top_k_logprobs(logits, top_k, temperature)
        teacher_prompts = rollout.prompts.prompt_tokens("teacher")
        for row, example in enumerate(batch):
            length = int(rollout.completion_mask[row].sum())
            rows[example["id"]] = {
                "tokens": rollout.completion_ids[row, :length].cpu(),
                "indices": indices[row, :length].cpu(),
                "logprobs": logprobs[row, :length].cpu(),
                "prompt_sha256": prompt_digest(teacher_prompts[row]),
            }
    write_cache(output, rows, {"top_k": top_k, "temperature": temperature, "token_columns": vocab, "teacher": teacher_name},
                cache_format, logprob_bits)
    return len(rows)

ENGINES = ("hf", "vllm")


def generate_teacher_data(
    teacher: ModelSpec,
    task: Task,
    output: str,
    split: str = "train",
    limit: int | None = None,
    samples_per_prompt: int = 1,
    temperature: float = 0.5,
    max_new_tokens: int = 512,
    max_prompt_tokens: int = 2048,
    batch_size: int = 16,
    verified_only: bool = False,
    seed: int = 42,
    device: str = "cpu",
    top_k: int | None = None,
    cache_temperature: float = 0.5,
    cache_format: str = "compact",
    cache_logprob_bits: int | None = None,
    engine: str = "hf",
    engine_args: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Sample the teacher on ``task``'s ``split`` (its own teacher prompts) and write ``output``.

    Args:
        teacher: the model that writes responses.
        task: prompts and verifier.
        output: JSONL file to write (its folder is created).
        split: which split's prompts (``train`` for distillation data).
        limit: only the first N prompts.
        samples_per_prompt: responses drawn per prompt.
        temperature: sampling temperature (the paper's teacher: 0.5; 0 = greedy).
        max_new_tokens, max_prompt_tokens, batch_size: generation limits.
        verified_only: keep only responses with score 1.
        seed: the sampling stream.
        device: where the teacher runs (``cpu``, ``cuda``).
        top_k: also write ``<output>.topk.safetensors``, the teacher's ``top_k`` log-probs at every position
            of every kept completion (:mod:`kdlab.rollouts.teacher_cache`), for ``CachedTeacherRollouts.teacher_cache``.
        cache_temperature: the teacher temperature of the cached log-probs; must equal the distillation's
            ``teacher_temperature`` (paper: 0.5). ``max_new_tokens`` also bounds the cached completions.
        cache_format: ``compact`` (ids Rice-coded, each log-prob as a ``cache_logprob_bits``-bit code within a
            documented bound: :mod:`kdlab.rollouts.cache_codec`; sizes in docs/benchmarks.md) or
            ``full`` (int64 ids and fp32 log-probs, 12 bytes per entry; exact, so ``top_k: V`` is the teacher
            exactly). ``CachedTeacherRollouts`` reads both.
        cache_logprob_bits: bits per log-prob of the compact format (4 to 16); ``null``: the most that keep
            the file within 300 bytes per completion token.
        engine: ``hf`` (kdlab's batched KV-cache decoder on ``device``) or ``vllm`` (``pip install
            'kdlab[vllm]'``, CUDA): the same prompts, end tokens and output format, request ``i`` seeded
            ``seed + i``. With ``top_k`` the cache is still computed by the Hugging Face teacher on
            ``device``, after vLLM has finished: leave it room with ``gpu_memory_utilization``.
        engine_args: keyword arguments for ``vllm.LLM`` (``tensor_parallel_size``,
            ``gpu_memory_utilization``, ``max_model_len``, ...); only with ``engine: vllm``.

    Returns ``{"prompts", "samples", "kept", "accuracy"}``.
    """
    for name, value in (("samples_per_prompt", samples_per_prompt), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"generate.{name} must be >= 1, got {value}")
    if temperature < 0:
        raise ValueError(f"generate.temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate.top_k must be >= 1 or null, got {top_k}")
    if not cache_temperature > 0:
        raise ValueError(f"generate.cache_temperature must be > 0, got {cache_temperature}")
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"generate.cache_format must be one of {CACHE_FORMATS}, got {cache_format!r}")
    if cache_logprob_bits is not None and not (isinstance(cache_logprob_bits, int) and MIN_BITS <= cache_logprob_bits <= MAX_BITS):
        raise ValueError(f"generate.cache_logprob_bits must be null or an integer in [{MIN_BITS}, {MAX_BITS}], got {cache_logprob_bits!r}")
    if engine not in ENGINES:
        raise ValueError(f"generate.engine must be one of {ENGINES}, got {engine!r}")
    if engine_args and engine != "vllm":
        raise ValueError(f"generate.engine_args are vLLM settings; set engine: vllm or drop them (got engine {engine!r})")
    tokenizer = load_tokenizer(teacher, "teacher")
    examples = task.examples(split)[:limit]
    if not examples:
        raise ValueError(f"{type(task).__name__}: the {split!r} split is empty")
    repeated = [example for example in examples for _ in range(samples_per_prompt)]
    model = None
    if engine == "vllm":
        from kdlab.rollouts.vllm import vllm_sample_completions

        samples = vllm_sample_completions(
            teacher, tokenizer, task, repeated, role="teacher", temperature=temperature, max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens, seed=seed, engine_args=engine_args,
        )
    else:
        model = load_causal_lm(teacher, "teacher").to(device)
        samples = sample_completions(
            model,
            tokenizer,
            task,
            repeated,
            role="teacher",
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens,
            batch_size=batch_size,
            generator=torch.Generator(device=device).manual_seed(seed),
        )
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = correct = 0
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as handle:
        for example, (text, ended) in zip(repeated, samples):
            score = float(task.score(example, text))
            correct += score
            if verified_only and score < 1.0:
                continue
            kept += 1
            row = {"id": example["id"], "completion": text, "score": score, "ended": ended}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    partial.replace(path)  # never leave a half-written dataset under the final name
    summary = {"prompts": len(examples), "samples": len(repeated), "kept": kept, "accuracy": correct / len(repeated)}
    if top_k is not None:
        from kdlab.rollouts.teacher_data import build_teacher_cache

        if model is None:
            model = load_causal_lm(teacher, "teacher").to(device)
        summary["cached"] = build_teacher_cache(
            model, tokenizer, task, str(path), str(path) + ".topk.safetensors", top_k, cache_temperature,
            max_new_tokens, max_prompt_tokens, batch_size, teacher_name=teacher.path, cache_format=cache_format,
            logprob_bits=cache_logprob_bits,
        )
    print(json.dumps({"output": str(path), **summary}))
    return summary
