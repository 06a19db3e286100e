"""Algorithms that run under ``simulate()``: the ``Algorithm`` interface and implementations."""

from batchrl.algos.base import Algorithm, Summary
from batchrl.algos.ppo import BatchPPO, KLPenalty, PPOConfig
from batchrl.algos.reinforce import Reinforce

__all__ = ["Algorithm", "Summary", "BatchPPO", "KLPenalty", "PPOConfig", "Reinforce"]
