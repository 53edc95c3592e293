"""Scoring completions: task accuracy (:mod:`kdlab.evaluation.scoring`), pass@k, update sparsity and
language share (:mod:`kdlab.evaluation.metrics`), and lm-evaluation-harness suites
(:mod:`kdlab.evaluation.lm_eval_suite`)."""


def __getattr__(name: str):
    """kdlab 0.1's names of this module path that moved (:data:`kdlab._legacy.MOVED`), with a FutureWarning."""
    from kdlab._legacy import moved_attribute

    return moved_attribute(__name__, name)
