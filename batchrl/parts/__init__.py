"""Building blocks shared by algorithms: normalisers, episode memory, returns, V-trace."""

from batchrl.parts.memory import EpisodeMemory, RolloutMemory
from batchrl.parts.normalize import StreamingNormalizer
from batchrl.parts.returns import discounted_cumsum, discounted_return, gae, generalized_advantage
from batchrl.parts.vtrace import VTrace, vtrace

__all__ = ["EpisodeMemory", "RolloutMemory", "StreamingNormalizer", "VTrace", "discounted_cumsum",
           "discounted_return", "gae", "generalized_advantage", "vtrace"]
