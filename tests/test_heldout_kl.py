"""HeldOutKL: full-vocabulary KL on teacher samples of held-out prompts, checked against a hand
computation with plain log-softmaxes, zero between identical models, and refused without a teacher."""

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from kdlab.callbacks import HeldOutKL
from kdlab.objectives.logits import completion_logits
from kdlab.stages import DistillModule
from kdlab.tasks import Addition


def bare_trainer(tmp_path):
    return pl.Trainer(accelerator="cpu", logger=TensorBoardLogger(tmp_path), enable_progress_bar=False)


def rows(trainer):
    return [json.loads(line) for line in open(f"{trainer.log_dir}/metrics.jsonl")]


def by_hand(module, rollouts):
    """Token-mean KL(T||S) and KL(S||T) with log_softmax on whole logits, tempered as the module does."""
    totals, count = torch.zeros(2, dtype=torch.float64), 0
    with torch.no_grad():
        for rollout in rollouts:
            length, mask = rollout.completion_ids.shape[1], rollout.completion_mask.bool()
            s = completion_logits(module.student, rollout.model_inputs("student"), length, module.token_columns) / module.student_temperature
            t = completion_logits(module.teacher, rollout.model_inputs("teacher"), length, module.token_columns) / module.teacher_temperature
            log_s, log_t = torch.log_softmax(s.double(), -1)[mask], torch.log_softmax(t.double(), -1)[mask]
            totals[0] += (log_t.exp() * (log_t - log_s)).sum()
            totals[1] += (log_s.exp() * (log_s - log_t)).sum()
            count += int(mask.sum())
    return (totals / count).tolist()


def test_heldout_kl_matches_a_hand_computation_and_reports_the_closed_share(tiny_pair, tmp_path):
    module = DistillModule(*tiny_pair, Addition(num_train=8, num_val=6), max_completion_tokens=6, batch_size=4,
                           teacher_temperature=0.5, student_temperature=1.0)
    trainer = bare_trainer(tmp_path)
    callback = HeldOutKL(examples=5, batch_size=2)  # 3 batches, the last one short
    callback.on_fit_start(trainer, module)
    forward, reverse = by_hand(module, callback._rollouts)
    (before,) = rows(trainer)
    assert before["heldout_kl/forward_before"] == pytest.approx(forward, rel=1e-5) and forward > 0.01
    assert before["heldout_kl/reverse_before"] == pytest.approx(reverse, rel=1e-5) and reverse > 0.01
    assert sum(int(r.completion_mask.shape[0]) for r in callback._rollouts) == 5
    with torch.no_grad():  # move the student: the same completions now give another KL
        module.student.lm_head.weight.mul_(0.5)
    callback.measure(trainer, module)
    after = rows(trainer)[-1]
    new_forward, _ = by_hand(module, callback._rollouts)
    assert after["heldout_kl/forward"] == pytest.approx(new_forward, rel=1e-5)
    assert after["heldout_kl/forward_closed"] == pytest.approx(1 - new_forward / forward, abs=1e-5)
    assert HeldOutKL(examples=1).state_dict() == {"before": {}}
    restored = HeldOutKL()
    restored.load_state_dict(callback.state_dict())
    assert restored.before == {"forward": pytest.approx(forward, rel=1e-5), "reverse": pytest.approx(reverse, rel=1e-5)}


def test_heldout_kl_is_zero_between_a_model_and_itself(tiny_pair, tmp_path):
    student, _ = tiny_pair
    module = DistillModule(student, student, Addition(num_train=8, num_val=4), max_completion_tokens=6, batch_size=4,
                           teacher_temperature=1.0, student_temperature=1.0)
    callback = HeldOutKL(examples=4, batch_size=4)
    trainer = bare_trainer(tmp_path)
    callback.on_fit_start(trainer, module)
    (row,) = rows(trainer)
    assert row["heldout_kl/forward"] == pytest.approx(0.0, abs=1e-6) and row["heldout_kl/reverse"] == pytest.approx(0.0, abs=1e-6)


def test_heldout_kl_refuses_a_stage_without_a_teacher(tiny_pair, tmp_path):
    from kdlab.stages import GRPOModule

    student, _ = tiny_pair
    with pytest.raises(ValueError, match="HeldOutKL .*needs a DistillModule, got GRPOModule"):
        HeldOutKL().setup(bare_trainer(tmp_path), GRPOModule(student, Addition(num_train=4, num_val=2)), "fit")
    with pytest.raises(ValueError, match="HeldOutKL.examples"):
        HeldOutKL(examples=0)


def test_the_gap_closed_is_in_the_end_summary_and_in_metrics_jsonl_at_the_last_step(tmp_path, capsys, monkeypatch):
    """The figure docs/real_model.md leads with: ``heldout_kl/forward_closed``, logged to metrics.jsonl at
    the final optimiser step (where kdlab report reads each run's last values) and printed by kdlab fit's
    end summary, beside the forward and reverse KL before -> after."""
    from pathlib import Path

    from kdlab.cli.main import main

    monkeypatch.setattr("sys.argv", ["kdlab"])
    smoke = Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml"
    cli = main(["fit", f"--config={smoke}", "--trainer.max_steps=3", "--trainer.limit_val_batches=0", f"--trainer.logger.init_args.save_dir={tmp_path}",
                "--trainer.callbacks+=kdlab.callbacks.HeldOutKL", "--trainer.callbacks.examples=4", "--trainer.callbacks.batch_size=4"])
    logged = [row for row in rows(cli.trainer) if "heldout_kl/forward_closed" in row]
    assert [row["step"] for row in logged] == [3]
    closed = logged[0]["heldout_kl/forward_closed"]
    out = capsys.readouterr().out
    assert f"  heldout_kl/forward_closed: {100 * closed:.1f}% at step 3  (HeldOutKL: share of the starting forward-KL gap" in out
    assert "  heldout_kl/forward: " in out and "  heldout_kl/reverse: " in out and "_before:" not in out


def test_student_prefixes_are_the_current_students_own_samples(tiny_pair, tmp_path):
    """prefixes="student": the KL on completions the student writes at each measurement (seeded, so a
    redraw from the same weights is the same), logged under heldout_kl/student_prefixes/."""
    module = DistillModule(*tiny_pair, Addition(num_train=8, num_val=6), max_completion_tokens=6, batch_size=4,
                           teacher_temperature=0.5, student_temperature=1.0)
    trainer = bare_trainer(tmp_path)
    teacher_side, student_side = HeldOutKL(examples=5, batch_size=2), HeldOutKL(examples=5, batch_size=2, prefixes="student")
    teacher_side.on_fit_start(trainer, module)
    student_side.on_fit_start(trainer, module)
    drawn = student_side.sample(module)
    assert [r.completion_ids.tolist() for r in drawn] == [r.completion_ids.tolist() for r in student_side.sample(module)]
    assert [r.completion_ids.tolist() for r in drawn] != [r.completion_ids.tolist() for r in teacher_side._rollouts]
    forward, reverse = by_hand(module, drawn)
    first, second = rows(trainer)
    assert set(first) >= {"heldout_kl/forward_before"} and "heldout_kl/student_prefixes/forward" not in first
    assert second["heldout_kl/student_prefixes/forward_before"] == pytest.approx(forward, rel=1e-5)
    assert second["heldout_kl/student_prefixes/reverse_before"] == pytest.approx(reverse, rel=1e-5)
    with torch.no_grad():
        module.student.lm_head.weight.mul_(0.5)  # another student writes other prefixes
    student_side.measure(trainer, module)
    redrawn = student_side.sample(module)
    assert [r.completion_ids.tolist() for r in redrawn] != [r.completion_ids.tolist() for r in drawn]
    new_forward, _ = by_hand(module, redrawn)
    after = rows(trainer)[-1]
    assert after["heldout_kl/student_prefixes/forward"] == pytest.approx(new_forward, rel=1e-5)
    assert after["heldout_kl/student_prefixes/forward_closed"] == pytest.approx(1 - new_forward / forward, abs=1e-5)
    with pytest.raises(ValueError, match="HeldOutKL.prefixes must be one of"):
        HeldOutKL(prefixes="both")
    both = pl.Trainer(accelerator="cpu", logger=False, callbacks=[teacher_side, student_side], enable_progress_bar=False)
    assert len({c.state_key for c in both.callbacks if isinstance(c, HeldOutKL)}) == 2  # one of each fits in a Trainer
