"""Scoring completions: task accuracy (:mod:`kdlab.evaluation.scoring`), pass@k, update sparsity and
language share (:mod:`kdlab.evaluation.metrics`), and lm-evaluation-harness suites
(:mod:`kdlab.evaluation.lm_eval_suite`)."""
