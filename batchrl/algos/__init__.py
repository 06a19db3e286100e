"""Algorithms that run under ``simulate()``: the ``Algorithm`` interface and implementations.

``PPOConfig`` and ``IMPALAConfig`` import without torch (``train.py`` checks a config with them
before it loads torch); the other names import their modules on first use (``batchrl.lazy``)."""

from batchrl.algos.impala_config import IMPALAConfig
from batchrl.algos.ppo_config import PPOConfig
from batchrl.lazy import lazy_names

_TORCH_NAMES = {"Algorithm": "batchrl.algos.base", "Summary": "batchrl.algos.base",
                "BatchPPO": "batchrl.algos.ppo", "KLPenalty": "batchrl.algos.ppo",
                "Reinforce": "batchrl.algos.reinforce", "IMPALA": "batchrl.algos.impala",
                "RolloutAlgorithm": "batchrl.algos.rollout", "SAC": "batchrl.algos.sac",
                "DQN": "batchrl.algos.dqn"}
__all__ = ["PPOConfig", "IMPALAConfig", *_TORCH_NAMES]
__getattr__, __dir__ = lazy_names(globals(), _TORCH_NAMES)
