"""Several learners (``train.learners = M``): ``run`` starts them here, on a Ray cluster or
as the learner ``torchrun`` started (``launch``); ``ray`` places them on a cluster."""

from batchrl.learners.launch import LearnerError, check_learners, run

__all__ = ["LearnerError", "check_learners", "run"]
