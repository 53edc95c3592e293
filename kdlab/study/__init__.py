"""The study around the runs: grids (:mod:`kdlab.study.sweep`), distill-then-RLVR chains
(:mod:`kdlab.study.pipeline`), reading finished runs (:mod:`kdlab.study.runs`), grouping and statistics
(:mod:`kdlab.study.groups`, :mod:`kdlab.study.stats`), tables and figures (:mod:`kdlab.study.report`,
:mod:`kdlab.study.tables`), the paper's numbers (:mod:`kdlab.study.paper`) and the verdicts against them
(:mod:`kdlab.study.verdicts`)."""
