"""OMP_NUM_THREADS=1 python experiments/smollm2/cross_tokenizer/heldout.py --checkpoint runs/smollm2-cross_tokenizer/version_0/checkpoints/final.ckpt --out experiments/smollm2/cross_tokenizer/heldout.json

The cross-tokenizer run's held-out KL again, before and after training, split into what it is made of.

``HeldOutKL`` (``heldout_kl/forward``) is the forward KL on the aligned events of
:mod:`kdlab.objectives.aligned`. With the trimmed student (``make_student.py``) every student token is
also a teacher token, so in a one-to-one group the student's ``rest`` event is empty (probability 0, held
as ``FLOOR`` = -1e4 in log space) while the teacher's holds its probability on the 32,768 tokens the
student lacks. Since commit 85ac711 (``drop_impossible_rest``) that rest is dropped on both sides and both
distributions renormalised, so ``heldout_kl/forward`` is the KL from the teacher conditioned on text the
student can write; before it, the rest was kept and counted as ``1e4 * p_T(rest)`` nats, which dominated the
figure (~144 nats, nearly constant under training). This script rebuilds the run's module (``--config``
files, the trained student weights from ``--checkpoint``; without it, the fresh student), draws HeldOutKL's
held-out teacher completions the same way (the first ``--examples`` ``val`` prompts, batches of
``--batch-size``, seed ``--seed + start``, TeacherRollouts at the module's teacher temperature) and reports,
as HeldOutKL weighs them (per batch the mean over groups, batches weighted by their student completion
tokens):

* ``kl_forward`` / ``kl_reverse``: the module's own divergences (what HeldOutKL logs);
* ``impossible_mass``: the teacher's probability on events the student gives probability 0;
* ``kl_forward_possible``: the forward KL from the teacher conditioned on the events the student can
  produce, ``KL(p_T(. | possible) || p_S)``, computed here from the raw events (a check: it equals
  ``kl_forward`` when the only impossible event is the dropped rest);
* ``kl_forward_with_rest``: the forward KL with the impossible events kept at ``FLOOR`` (what
  ``heldout_kl/forward`` was before 85ac711: ``~1e4 * impossible_mass`` plus the rest);
* ``nats_per_byte``: the student's negative log-likelihood of the completions' text (its own tokens,
  the end token included) per byte: tokenizer-independent, comparable with ``before.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

BASE = ["experiments/smollm2/base.yaml", "experiments/smollm2/cross_tokenizer.yaml"]


@torch.no_grad()
def split_kl(module, rollout) -> dict[str, float]:
    """The module's divergences of one rollout, and the event KL split into the possible and impossible parts."""
    from kdlab.objectives.aligned import FLOOR, EventLayout, side_events
    from kdlab.objectives.lazy import gather_rows

    values = {name: float(value) for name, value in module.divergences(rollout, "token").items()}
    cross = module.cross_tokenizer
    student, teacher = module.distillation_logits(rollout)
    teacher_ids, teacher_mask = rollout.completion("teacher")
    student_ids, student_mask = rollout.completion_ids, rollout.completion_mask
    groups = cross.groups(student_ids, student_mask, teacher_ids, teacher_mask)
    vocabulary = cross.vocabulary
    s_layout, t_layout = EventLayout.of(vocabulary, "student"), EventLayout.of(vocabulary, "teacher")
    dtype = torch.float32
    sums = torch.zeros(4, dtype=torch.float64)
    for chunk in groups.chunks(64):
        part = groups.chunk(chunk, student_ids, teacher_ids, vocabulary)
        _, t_events = side_events(gather_rows(teacher, part.teacher.b, part.teacher.t, dtype), part.teacher, t_layout, part.removed)
        _, s_events = side_events(gather_rows(student, part.student.b, part.student.t, dtype), part.student, s_layout, part.removed)
        possible = s_events > FLOOR / 2
        p_t = t_events.exp()
        impossible = (p_t * ~possible).sum(-1)
        kept = torch.where(possible, t_events, torch.full_like(t_events, FLOOR))
        conditional = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
        kl_possible = (conditional.exp() * (conditional - torch.where(possible, s_events, 0.0))).sum(-1)
        full = (p_t * (t_events - s_events)).sum(-1)
        sums += torch.stack([full.sum(), impossible.sum(), kl_possible.sum(), torch.tensor(float(len(chunk)))]).double()
    values["kl_forward_with_rest"] = float(sums[0] / sums[3])
    values["impossible_mass"] = float(sums[1] / sums[3])
    values["kl_forward_possible"] = float(sums[2] / sums[3])
    # the completion text's negative log-likelihood under the student, per byte
    logprobs = torch.log_softmax(gather_rows(student, *student_mask.nonzero(as_tuple=True), dtype), dim=-1)
    realized = logprobs.gather(1, student_ids[student_mask][:, None]).squeeze(1)
    size = sum(len(vocabulary.student_bytes[i]) for i in student_ids[student_mask].tolist())
    values["nll"], values["bytes"] = float(-realized.sum()), size
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", nargs="+", default=BASE)
    parser.add_argument("--checkpoint", help="the run's Lightning checkpoint (its student weights); none: the fresh student")
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="experiments/smollm2/cross_tokenizer/heldout.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from kdlab.cli.main import main as kdlab_main
    from kdlab.rollouts.policies import TeacherRollouts

    argv = ["fit", *[word for path in args.config for word in ("--config", path)], "--trainer.logger=false",
            "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
    sys.argv[1:] = []  # the CLI reads argv, not this script's arguments
    module = kdlab_main(argv, run=False).model
    module.fused_lm_head = False  # plain student logits (the values are the same)
    states = {"before": None}
    if args.checkpoint:
        states["after"] = args.checkpoint
    examples = list(module.task.examples("val"))[: args.examples]
    fresh = {name: tensor.clone() for name, tensor in module.student.state_dict().items()}
    rollouts = [module.make_rollout(examples[start : start + args.batch_size], args.seed + start, policy=TeacherRollouts())
                for start in range(0, len(examples), args.batch_size)]
    result: dict = {"config": args.config, "checkpoint": args.checkpoint, "examples": len(examples),
                    "completion_tokens": {"student": sum(int(r.completion_mask.sum()) for r in rollouts),
                                          "teacher": sum(int(r.completion("teacher")[1].sum()) for r in rollouts)}}
    for name, checkpoint in states.items():
        if checkpoint is None:
            module.student.load_state_dict(fresh)
        else:
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
            student = {key[len("student."):]: value for key, value in state.items() if key.startswith("student.")}
            missing, unexpected = module.student.load_state_dict(student, strict=False)
            assert not unexpected and all("lm_head" in key for key in missing), (missing, unexpected)
        module.student.eval()
        totals: dict[str, float] = {}
        tokens = nll = size = 0.0
        for rollout in rollouts:
            count = int(rollout.completion_mask.sum())
            values = split_kl(module, rollout)
            for key in ("kl_forward", "kl_reverse", "teacher_unmapped_mass", "one_to_one_share", "kl_forward_with_rest",
                        "impossible_mass", "kl_forward_possible"):
                totals[key] = totals.get(key, 0.0) + values[key] * count
            tokens += count
            nll, size = nll + values["nll"], size + values["bytes"]
        result[name] = {key: value / tokens for key, value in totals.items()} | {"nats_per_byte": nll / size}
        print(name, result[name], flush=True)
    if "after" in result:
        for key in ("kl_forward", "kl_forward_possible", "kl_reverse"):
            result[f"{key}_closed"] = 1.0 - result["after"][key] / result["before"][key]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
