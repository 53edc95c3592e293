"""The worked example of docs/cross_tokenizer.md: one sentence, both tokenizations, the aligned groups and
the events of each model at every group, computed from the packaged tiny models.

    python scripts/cross_tokenizer_example.py [--check]

Writes the block between ``<!-- example: start -->`` and ``<!-- example: end -->`` of docs/cross_tokenizer.md
(``--check``: exit 1 if the page differs). Student: ``kdlab://tiny/student`` (digits one by one); teacher:
``kdlab://tiny/teacher-xtok`` (numbers kept whole). Each model reads the sentence as the completion of a
Countdown-3 prompt in its own chat template; probabilities at teacher temperature 0.5 and student 1.0, as
in ``experiments/tiny/cross_tokenizer.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cross_tokenizer.md"
START, END = "<!-- example: start -->", "<!-- example: end -->"
STUDENT, TEACHER = "kdlab://tiny/student", "kdlab://tiny/teacher-xtok"
SENTENCE = "25-7=18, 18*3=54"


def show(piece: bytes) -> str:
    text = piece.decode("utf-8", errors="backslashreplace")
    return "`" + text.replace("`", "\\`").replace("\n", "\\n").replace("|", "\\|") + "`" if text else "(end)"


def example() -> str:
    from kdlab.objectives.aligned import FLOOR, CrossTokenizer
    from kdlab.rollouts.policies import TeacherDatasetRollouts
    from kdlab.stages.distill import DistillModule
    from kdlab.tasks import Countdown

    torch.manual_seed(0)
    task = Countdown(variant="countdown3", instruction=False, system_prompt="", num_train=1, num_val=1, num_test=0, seed=0)
    example_ = task.examples("train")[0]
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "one.jsonl"
        data.write_text(json.dumps({"id": example_["id"], "completion": SENTENCE}) + "\n")
        module = DistillModule(STUDENT, TEACHER, task, rollout=TeacherDatasetRollouts(str(data)), cross_tokenizer=CrossTokenizer(),
                               max_completion_tokens=64, val_examples=1)
        rollout = module.make_rollout([example_], 0)
    cross = module.cross_tokenizer
    vocabulary = cross.vocabulary
    s_ids, s_mask = rollout.completion_ids, rollout.completion_mask
    t_ids, t_mask = rollout.completion("teacher")
    groups = cross.groups(s_ids, s_mask, t_ids, t_mask)
    s_tokens, t_tokens = s_ids[0][s_mask[0]].tolist(), t_ids[0][t_mask[0]].tolist()
    with torch.no_grad():
        student, teacher = module.distillation_logits(rollout)
        s_log, t_log = torch.log_softmax(student[0].float(), -1), torch.log_softmax(teacher[0].float(), -1)
    lines = [f"The sentence `{SENTENCE}` as a completion (then each model's end token), in each model's tokens:\n",
             f"- student (`{STUDENT}`, {len(vocabulary.student_bytes)} tokens): " + " ".join(show(vocabulary.student_bytes[i]) if i not in vocabulary.student_specials else "`<end>`" for i in s_tokens),
             f"- teacher (`{TEACHER}`, {len(vocabulary.teacher_bytes)} tokens): " + " ".join(show(vocabulary.teacher_bytes[i]) if i not in vocabulary.teacher_specials else "`<end>`" for i in t_tokens),
             "",
             f"The finest groups that cover the same bytes ({len(groups)} groups; {100 * groups.one_to_one_share:.1f}% of the bytes in "
             f"one-to-one groups). `p_S(x)`, `p_T(x)`: each model's chain-rule probability of the group's text; `p(rest)`: "
             f"each model's probability of the group's `rest` event (tokens outside the map of {vocabulary.size} shared tokens, "
             f"the left-out pair, the first token not followed by the rest of the group):\n",
             "| group | bytes | student tokens | teacher tokens | kind | p_S(x) | p_T(x) | p_S(rest) | p_T(rest) |",
             "| ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    from kdlab.objectives.aligned import EventLayout, event_logprobs

    for g in range(len(groups)):
        s0, sn = int(groups.student_start[g]), int(groups.student_length[g])
        t0, tn = int(groups.teacher_start[g]), int(groups.teacher_length[g])
        pieces_s = [vocabulary.student_bytes[s_tokens[k]] if s_tokens[k] not in vocabulary.student_specials else b"" for k in range(s0, s0 + sn)]
        pieces_t = [vocabulary.teacher_bytes[t_tokens[k]] if t_tokens[k] not in vocabulary.teacher_specials else b"" for k in range(t0, t0 + tn)]
        kind = "one to one" if sn == tn == 1 else f"{sn} student : {tn} teacher"
        removed = torch.tensor([[int(vocabulary.student_pair[s_tokens[s0]]), int(vocabulary.teacher_pair[t_tokens[t0]])]])
        events = []
        for side, log, tokens, start, n in (("student", s_log, s_tokens, s0, sn), ("teacher", t_log, t_tokens, t0, tn)):
            rows = torch.arange(start, start + n)
            ids = torch.tensor(tokens)[rows]
            realized = log[rows, ids]
            events.append(event_logprobs(log[start][None], realized, torch.zeros(n, dtype=torch.long), torch.tensor([0]),
                                         ids[:1], EventLayout.of(vocabulary, side), removed)[0])
        p = lambda value: f"{float(value.exp()):.3f}" if float(value) > FLOOR / 2 else "0"  # noqa: E731
        text = b"".join(pieces_s)
        lines.append(f"| {g + 1} | {show(text)} | {' '.join(show(x) for x in pieces_s)} | {' '.join(show(x) for x in pieces_t)} | {kind} "
                     f"| {p(events[0][-2])} | {p(events[1][-2])} | {p(events[0][-1])} | {p(events[1][-1])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cross_tokenizer.md's example differs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    page = PAGE.read_text(encoding="utf-8")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    new = head + START + "\n" + example() + END + tail
    if args.check:
        if new != page:
            print("docs/cross_tokenizer.md's worked example differs from what scripts/cross_tokenizer_example.py computes")
            sys.exit(1)
        return
    PAGE.write_text(new, encoding="utf-8")
    print(f"wrote the example into {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
