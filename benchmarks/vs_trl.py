"""kdlab vs TRL's GKDTrainer on the same off-policy forward-KL step, side by side on CPU (one thread).

Both take one full training step (teacher forward, student forward-backward, full-vocabulary forward
KL, AdamW step) on the same two conversations (B = 2, about 512 tokens each) with the same random
Qwen2-architecture pair (V = 151,936; TRL needs equal embedding sizes, so neither model is padded):

* TRL: ``trl.experimental.gkd.GKDTrainer`` with ``lmbda=0`` (no on-policy generation: off-policy),
  ``beta=0`` (forward KL), ``temperature=1``; its ``compute_loss``, backward, then ``torch.optim.AdamW``;
* kdlab: ``DistillModule`` with ``TeacherRollouts(dataset=...)`` on the same completion text and both
  temperatures 1; ``training_step``, backward, then AdamW.

Reported: completion tokens per second (median of ``--repeats`` steps after a warm-up step) and peak
extra memory of one step after the warm-up (fresh process per library, peak RSS via /proc, so the
optimiser state already exists). Targets: kdlab >= 1.8x TRL's tokens/s and <= 0.35x its extra peak.

TRL is a benchmark-only dependency (``pip install trl``); this script installs nothing. Exits 0
whether or not the targets are met.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kl_memory import proc_kib, reset_peak_rss  # noqa: E402
from step_and_decoding import pair  # noqa: E402

COMPLETION = "x " * 250  # about 500 tokens with the tiny byte-level tokenizer


def trl_step(student_path: str, teacher_path: str, out: Path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer = AutoTokenizer.from_pretrained(student_path)
    student = AutoModelForCausalLM.from_pretrained(student_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": COMPLETION}]} for a, b in ((1, 2), (3, 4))]
    dataset = Dataset.from_list(rows)
    args = GKDConfig(output_dir=str(out / "trl"), lmbda=0.0, beta=0.0, temperature=1.0, per_device_train_batch_size=2,
                     max_length=2048, report_to=[], use_cpu=True, max_steps=1)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset, processing_class=tokenizer)
    batch = trainer.data_collator([dataset[0], dataset[1]])
    tokens = int((batch["labels"] != -100).sum())
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, batch).backward()
        optimizer.step()

    return step, tokens


def kdlab_step(student_path: str, teacher_path: str, out: Path):
    from kdlab.module import DistillModule
    from kdlab.rollouts import TeacherRollouts
    from kdlab.tasks import Addition

    task = Addition(num_train=2, num_val=0, num_test=0)
    data = out / "teacher.jsonl"
    data.write_text("".join(json.dumps({"id": ex["id"], "completion": COMPLETION}) + "\n" for ex in task.examples("train")))
    module = DistillModule(student_path, teacher_path, task, rollout=TeacherRollouts(dataset=str(data)), teacher_temperature=1.0,
                           student_temperature=1.0, max_completion_tokens=2048, batch_size=2, max_prompt_tokens=256)
    module.log = lambda *args, **kwargs: None  # no Trainer attached
    examples = task.examples("train")
    tokens = int(module.make_rollout(examples, 0).completion_mask.sum())
    optimizer = torch.optim.AdamW(module.student.parameters(), lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        module.training_step(examples, 0).backward()
        optimizer.step()

    return step, tokens


def child(args) -> None:
    torch.set_num_threads(1)
    out = Path(args.folder)
    make = trl_step if args.child == "trl" else kdlab_step
    step, tokens = make(str(out / "student"), str(out / "teacher"), out)
    step()  # warm-up: optimiser state exists from here on
    reset = reset_peak_rss()
    baseline = proc_kib("VmRSS")
    step()
    extra = (proc_kib("VmHWM") - baseline) / 1024
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"tokens": tokens, "time_s": statistics.median(times), "extra_mib": extra, "reset": reset}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--child", choices=("trl", "kdlab"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed (pip install trl); nothing measured")
        return
    with tempfile.TemporaryDirectory() as folder:
        pair(args.vocab, Path(folder), pad_teacher=False)
        res = {}
        for impl in ("trl", "kdlab"):
            out = subprocess.run([sys.executable, __file__, f"--repeats={args.repeats}", f"--child={impl}", f"--folder={folder}"],
                                 check=True, capture_output=True, text=True).stdout
            res[impl] = json.loads(out.strip().splitlines()[-1])
    print(f"V={args.vocab}, B=2, one thread, median of {args.repeats} steps (forward KL, off-policy, AdamW)")
    print(f"{'library':<8}{'tokens':>8}{'step s':>10}{'tokens/s':>11}{'extra peak MiB':>16}")
    for impl, r in res.items():
        r["rate"] = r["tokens"] / r["time_s"]
        print(f"{impl:<8}{r['tokens']:>8}{r['time_s']:>10.3f}{r['rate']:>11.0f}{r['extra_mib']:>16.0f}")
    speed = res["kdlab"]["rate"] / res["trl"]["rate"]
    memory = res["kdlab"]["extra_mib"] / res["trl"]["extra_mib"]
    print(f"tokens/s kdlab/TRL: {speed:.2f} (target >= 1.8: {'met' if speed >= 1.8 else 'NOT met'})")
    print(f"extra peak memory kdlab/TRL: {memory:.2f} (target <= 0.35: {'met' if memory <= 0.35 else 'NOT met'})")


if __name__ == "__main__":
    main()
