"""Two time ratios of the issue "Scale", measured side by side in one run on CPU (one thread):

1. ``step``: one kdlab off-policy forward-KL distillation step (``DistillModule.training_step`` on a
   fixed teacher completion, then backward: student and teacher forwards, the chunked full-vocabulary
   KL with its closed-form gradient, and the exact KL/entropy diagnostics logged every step) divided by
   the floor any distillation step pays: a teacher forward (no grad) plus a student forward-backward
   with standard cross-entropy on the same tokens. Target <= 1.05.
2. ``decode``: joint mixture decoding (``MixtureRollouts(lam=0)``, both models stepping together with
   their own KV caches) divided by the student's and the teacher's decoding alone, summed. Target <= 1.15.

Models: random-initialised Qwen2 pair with the real Qwen2.5 vocabulary size (V = 151,936), a small body
(hidden 64, 2 layers) so the vocabulary dominates as it does in distillation; B = 2, T = 512 for the step.

    python benchmarks/step_and_decoding.py [--repeats 5] [--vocab 151936] [--tokens 512] [--decode 64]

Prints medians over ``--repeats`` runs after one warm-up, the ratios, and whether each target is met;
exits 0 either way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def pair(vocab: int, out: Path, pad_teacher: bool = False):
    """A student/teacher folder pair sharing the packaged tiny tokenizer, with ``vocab`` embedding rows
    (the teacher 128 more with ``pad_teacher``, as real families pad)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from kdlab.models import resolve_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_path("kdlab://tiny-random/student"))
    for role, seed, hidden in (("student", 1, 64), ("teacher", 2, 96)):
        torch.manual_seed(seed)
        rows = vocab + 128 if pad_teacher and role == "teacher" else vocab
        config = Qwen2Config(vocab_size=rows, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(out / role)
        tokenizer.save_pretrained(out / role)
    return str(out / "student"), str(out / "teacher")


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_ratio(student: str, teacher: str, tokens: int, repeats: int) -> tuple[float, float]:
    from kdlab.data import Rollout
    from kdlab.decoding import completion_logits
    from kdlab.module import DistillModule
    from kdlab.tasks import Addition

    module = DistillModule(student, teacher, Addition(num_train=2), max_completion_tokens=tokens, batch_size=2, max_prompt_tokens=256)
    vocab = module.vocab_size
    examples = module.task.examples("train")[:2]
    prompts = module._prompts(examples)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(module.student_tokenizer), (2, tokens), generator=generator)
    mask = torch.ones(2, tokens, dtype=torch.bool)
    rollout = Rollout(prompts, ids, mask)
    module.make_rollout = lambda batch, seed, policy=None: rollout  # a fixed off-policy completion
    module.log = lambda *args, **kwargs: None  # no Trainer attached

    def kdlab_step():
        module.student.zero_grad(set_to_none=True)
        module.training_step(examples, 0).backward()

    def floor_step():
        module.student.zero_grad(set_to_none=True)
        with torch.no_grad():
            completion_logits(module.teacher, rollout.model_inputs("teacher"), tokens, vocab)
        logits = completion_logits(module.student, rollout.model_inputs("student"), tokens, vocab)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), ids.reshape(-1)).backward()

    return median_time(kdlab_step, repeats), median_time(floor_step, repeats)


def decode_ratio(student: str, teacher: str, new_tokens: int, repeats: int) -> tuple[float, float, float]:
    from kdlab.module import DistillModule
    from kdlab.rollouts import MixtureRollouts, StudentRollouts, TeacherRollouts
    from kdlab.tasks import Addition

    module = DistillModule(student, teacher, Addition(num_train=8), max_completion_tokens=new_tokens, batch_size=8)
    module.end_ids = (-1,)  # never stop early: every policy decodes exactly new_tokens tokens
    examples = module.task.examples("train")
    times = []
    for policy in (MixtureRollouts(lam=0.0), StudentRollouts(), TeacherRollouts()):
        times.append(median_time(lambda policy=policy: module.make_rollout(examples, 0, policy), repeats))
    return tuple(times)


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        student, teacher = pair(args.vocab, Path(folder))
        kdlab_step, floor_step = step_ratio(student, teacher, args.tokens, args.repeats)
        joint, alone_student, alone_teacher = decode_ratio(student, teacher, args.decode, args.repeats)
    step = kdlab_step / floor_step
    decode = joint / (alone_student + alone_teacher)
    print(f"V={args.vocab}, B=2, T={args.tokens}, one thread, median of {args.repeats}")
    print(f"step:   kdlab {kdlab_step:.3f} s, teacher forward + student CE forward-backward {floor_step:.3f} s, "
          f"ratio {step:.3f} (target <= 1.05: {'met' if step <= 1.05 else 'NOT met'})")
    print(f"decode: joint mixture {joint:.3f} s, student alone {alone_student:.3f} s + teacher alone {alone_teacher:.3f} s, "
          f"ratio {decode:.3f} (target <= 1.15: {'met' if decode <= 1.15 else 'NOT met'})")


if __name__ == "__main__":
    main()
