"""Decoupled collection: collector processes (or Ray actors) that step their own envs with a copy
of the algorithm's acting part and send fixed-length rollouts to the learner, which learns from
them without stopping them (``train.collectors``). ``RayCollectors`` (``batchrl.collectors.ray``)
imports Ray: import it from there."""

from batchrl.collectors.collector import (CollectorError, CollectorSpec, Link, Recorder, collect,
                                         collector_seed)
from batchrl.collectors.local import LocalCollectors

__all__ = ["CollectorError", "CollectorSpec", "Link", "LocalCollectors", "Recorder", "collect",
           "collector_seed"]
