"""What kdlab asks vLLM to sample and how it reads the answer back: kdlab's sampling settings as
``vllm.SamplingParams`` keywords (:func:`sampling_params`), the same settings as the fields of a ``/v1/completions``
request to ``vllm serve`` (:func:`completion_fields`: the served teacher's and the served student's samples), the
bias that keeps a head's padding rows out of the sample (:func:`padding_rows_bias`), and the sampled ids and
log-probs of an output, checked
(:func:`checked_token_ids`, :func:`sampled_token_logprobs`). The engine and the rollout policy that use them are
in :mod:`kdlab.rollouts.vllm`; ``python scripts/check_vllm_api.py`` checks these names against vLLM itself."""

from __future__ import annotations

from typing import Any

VLLM_TEMPERATURES = (0.01, 2.0)
"""The non-zero sampling temperatures vLLM honours exactly (checked against vLLM's ``SamplingParams``)."""


def check_temperature(temperature: float, setting: str) -> None:
    """``ValueError`` naming ``setting`` unless vLLM samples at ``temperature`` exactly: 0 (greedy) or within
    :data:`VLLM_TEMPERATURES` (vLLM rejects T > 2 and silently raises T < 0.01 to 0.01, which would make the
    distribution it samples differ from kdlab's)."""
    if temperature != 0 and not VLLM_TEMPERATURES[0] <= temperature <= VLLM_TEMPERATURES[1]:
        raise ValueError(f"{setting}: vLLM samples at temperature 0 or in {list(VLLM_TEMPERATURES)}, got {temperature}")


def sampling_params(
    temperature: float,
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    top_p: float = 1.0,
    seed: int | None = None,
    logprobs: bool = True,
    stop: tuple[str, ...] = (),
    logit_bias: dict[int, float] | None = None,
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments equivalent to kdlab's sampling.

    kdlab samples from ``softmax(logits / temperature)`` (optionally top-p), stops at any of the end
    tokens and keeps that end token in the completion; it never adds penalties. ``temperature`` 0 is
    greedy. ``logprobs=True`` asks for the log-prob of each sampled token (``logprobs=0``: the sampled
    token only), which the importance weight needs. vLLM reports the raw model's log-probs by default;
    ``VLLMRollouts`` builds its engine with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10) so
    they are those of the distribution it sampled from (tempered, and top-p truncated when
    ``top_p < 1``).

    ``stop`` strings end a completion like kdlab's decoder does (:func:`kdlab.rollouts.decoding.stop_strings_check`):
    the tokens up to and including the one that completes the string are kept. vLLM checks them on the
    detokenised text, so they switch detokenisation on (vLLM refuses stop strings without it), and
    ``include_stop_str_in_output`` keeps the returned text whole. vLLM keeps the token ids up to and
    including the completing one (it drops only surplus tokens of the same step, e.g. speculative ones).

    ``logit_bias`` (:func:`padding_rows_bias`): for a model whose head has padding rows (Qwen2.5: 151,936 rows,
    151,665 tokens), :data:`PADDING_BIAS` on each of them. vLLM adds it before it samples and before its processed
    log-probs, so those rows hold no mass in fp32 and vLLM samples kdlab's distribution (kdlab's decoder drops
    those columns); an id past the tokenizer that comes back anyway is refused (:func:`checked_token_ids`). A
    bias on the few padding rows, not ``allowed_token_ids``: that would be a list of every token, copied and
    checked in Python for each request.
    """
    check_temperature(temperature, "sampling_params")
    if not 0 < top_p <= 1:
        raise ValueError(f"sampling_params: top_p must be in (0, 1], got {top_p}")
    params: dict[str, Any] = {
        "n": 1,
        "temperature": float(temperature),
        "top_p": float(top_p) if temperature > 0 else 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": int(max_new_tokens),
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": False,
        "skip_special_tokens": False,
        "detokenize": bool(stop),
        "seed": seed,
    }
    if stop:
        params["stop"] = [text for text in stop]
        params["include_stop_str_in_output"] = True
    if logprobs:
        params["logprobs"] = 0
    if logit_bias:
        params["logit_bias"] = logit_bias
    return params


def completion_fields(params: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` fields (vLLM's OpenAI-compatible ``CompletionRequest``) that ask ``vllm serve`` for
    the sampling that :func:`sampling_params` keywords ``params`` give the in-process engine: the same names and
    values, every setting pinned (``top_k``, ``min_p`` and the repetition, presence and frequency penalties
    included: the server fills a field left out from the model's ``generation_config.json``, e.g.
    ``repetition_penalty: 1.1`` for Qwen2-1.5B-Instruct), ``logit_bias`` keyed by the id as text (JSON's keys),
    and no ``detokenize``, which the request does not have (the server writes the text, and checks stop strings
    on it)."""
    fields = {key: value for key, value in params.items() if key != "detokenize"}
    if fields.get("logit_bias"):
        fields["logit_bias"] = {str(row): float(bias) for row, bias in fields["logit_bias"].items()}
    return fields


PADDING_BIAS = -100.0
"""The logit bias on a head's padding rows: vLLM's lowest (it clamps biases to [-100, 100])."""


def padding_bias(head_rows: int, token_columns: int) -> dict[int, float] | None:
    """``{row: PADDING_BIAS}`` for each of an output layer's ``head_rows`` rows past the tokenizer's ``token_columns``
    tokens; ``None`` when there are none."""
    return {row: PADDING_BIAS for row in range(token_columns, head_rows)} or None


def padding_rows_bias(spec: Any, token_columns: int) -> dict[int, float] | None:
    """:func:`padding_bias` of the model ``spec`` names (its config's ``vocab_size`` rows) past its tokenizer's
    ``token_columns`` tokens. One mapping, shared by every request."""
    from kdlab.models.loading import load_config, output_rows

    return padding_bias(output_rows(load_config(spec)), token_columns)


def checked_token_ids(outputs: Any, token_columns: int, setting: str) -> list[list[int]]:
    """The sampled ids of each vLLM output, refused with an error naming ``setting`` when one is no token of the
    tokenizer (``>= token_columns``): a padding row of the head, which nothing downstream can read."""
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    outside = [token for row in tokens for token in row if not 0 <= token < token_columns]
    if outside:
        raise RuntimeError(f"{setting}: vLLM sampled token id {outside[0]}, outside the tokenizer's {token_columns} tokens "
                           "(a padding row of the head, which kdlab biases by {PADDING_BIAS:g})")
    return tokens


def sampled_token_logprobs(sample: Any) -> list[float]:
    """The log-prob of each sampled token of a vLLM ``CompletionOutput`` (requested with ``logprobs=0``).

    ``sample.logprobs`` holds one ``{token id: Logprob}`` mapping per position (a list of dicts, or vLLM's
    ``FlatLogprobs``, which reads the same); the sampled token is always among its keys."""
    return [float(entry[token].logprob) for token, entry in zip(sample.token_ids, sample.logprobs or [])]
