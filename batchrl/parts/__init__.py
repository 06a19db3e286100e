"""Building blocks shared by algorithms: normalisers, episode memory, returns."""

from batchrl.parts.memory import EpisodeMemory, RolloutMemory
from batchrl.parts.normalize import StreamingNormalizer
from batchrl.parts.returns import discounted_cumsum, discounted_return, gae, generalized_advantage

__all__ = ["EpisodeMemory", "RolloutMemory", "StreamingNormalizer", "discounted_cumsum",
           "discounted_return", "gae", "generalized_advantage"]
