"""The paper's headline numbers (Piskorz, Berthon, van der Schaar, Headline results), which the report
prints beside the matching rows and the verdicts test against."""

from __future__ import annotations

from dataclasses import dataclass

PAPER_LR = {1e-5: "low", 5e-5: "high"}
# the tasks of the paper's headline numbers (a run's task: Countdown's variant, else the task's class name)
HEADLINE_TASKS = ("countdown3", "Science", "MedReason")
# every task the paper runs: Countdown-4E is measured from the Countdown-3 students, RLVR is on Countdown-4
PAPER_TASKS = (*HEADLINE_TASKS, "countdown4", "countdown4e")


def is_paper_task(task: str, tasks: tuple[str, ...] = PAPER_TASKS) -> bool:
    """Whether a run's task (Countdown's variant, else the task's class name) is one of ``tasks``."""
    return task.lower() in {t.lower() for t in tasks}


# ---- the paper's numbers -------------------------------------------------------------------------
PAPER = "Piskorz, Berthon, van der Schaar, arXiv 2609.35259, Headline results"


@dataclass(frozen=True)
class PaperResult:
    """A headline number of the paper (Qwen/Llama on Countdown-3, Science, MedReason), in report units.

    ``tasks`` (the tasks the number was measured on), ``rollout`` (``OffPD``/``OnPD``), ``direction``
    (``forward``/``reverse``) and ``lr`` (``low`` = 1e-5, ``high`` = 5e-5) say which rows it is compared
    with; None means any. A row of another task (SmolLM2 on Counting, say) is never given a paper number.
    Every number is the paper's over both of its model pairs (Qwen2.5-7B -> 1.5B, Llama-3.1-8B -> 3.2-1B),
    so none is tied to one pair.
    """

    key: str
    metric: str
    value: str
    claim: str
    source: str
    rollout: str | None = None
    direction: str | None = None
    lr: str | None = None
    tasks: tuple[str, ...] = HEADLINE_TASKS

    def applies_to(self, task: str) -> bool:
        return is_paper_task(task, self.tasks)


_BEST = "Best mean accuracy: OnPD 72% vs OffPD 73% (no consistent on-policy advantage)."
_KL = "Forward KL 71-73% across every rollout policy and LR; reverse KL 35-72%, LR-sensitive."
_FORGET = "Forgetting: at LR 1e-5 mean OOD change <= 1.3 points; at 5e-5 drops of 11.2-14.0 points."
_SPARSE = "Sparsity: 85.3-89.6% at 1e-5 vs 51.9-60.0% at 5e-5; OffPD at least as sparse as OnPD."
PAPER_RESULTS = (
    PaperResult("P1", "val/accuracy", "72", "best mean accuracy, OnPD", _BEST, rollout="OnPD"),
    PaperResult("P2", "val/accuracy", "73", "best mean accuracy, OffPD", _BEST, rollout="OffPD"),
    PaperResult("P3", "val/accuracy", "71-73", "forward KL, every rollout policy and LR", _KL, direction="forward"),
    PaperResult("P4", "val/accuracy", "35-72", "reverse KL, LR-sensitive", _KL, direction="reverse"),
    PaperResult("P5", "ood/mean_delta", "|change| <= 1.3", "mean OOD change at LR 1e-5", _FORGET, lr="low"),
    PaperResult("P6", "ood/mean_delta", "-14.0 to -11.2", "mean OOD drop at LR 5e-5", _FORGET, lr="high"),
    PaperResult("P7", "sparsity/1e-06", "85.3-89.6", "update sparsity (tau 1e-6) at LR 1e-5", _SPARSE, lr="low"),
    PaperResult("P8", "sparsity/1e-06", "51.9-60.0", "update sparsity (tau 1e-6) at LR 5e-5", _SPARSE, lr="high"),
)
# each note's tasks: it is printed under a section only when a row of the section is on one of them
PAPER_NOTE_TASKS = {
    "spectrum": ("countdown3",),  # the paper's lambda spectrum is a Countdown-3 ablation
    "pass@k": ("countdown3", "countdown4", "countdown4e"),  # Countdown-3 students measured on Countdown-4E, RLVR on Countdown-4
    "style": HEADLINE_TASKS,
}
PAPER_NOTES = {
    "spectrum": "Spectrum: forward KL stays above 80% held-out across lambda (5.2-point spread at 1e-5); "
    "reverse KL favours lambda > 0 and is unstable at the high LR.",
    "pass@k": "On-policy rollouts give 10-15% higher pass@k on Countdown-4E; the edge does not survive RLVR.",
    "style": "OnPD + reverse KL keeps the student's English style; other settings transfer Spanish almost fully.",
}
