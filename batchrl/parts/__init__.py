"""Building blocks shared by algorithms: normalisers, episode memory, returns."""

from batchrl.parts.memory import EpisodeMemory
from batchrl.parts.normalize import StreamingNormalizer
from batchrl.parts.returns import discounted_return, generalized_advantage

__all__ = ["EpisodeMemory", "StreamingNormalizer", "discounted_return",
           "generalized_advantage"]
