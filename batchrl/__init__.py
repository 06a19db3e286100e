"""batchrl: batched simulation for reinforcement learning in PyTorch.

The main names are importable from here::

    from batchrl import (simulate, BatchEnv, TensorBatchEnv, ExternalProcess, EnvWorker,
                         make_batch_env, BatchVectorEnv, Algorithm, BatchPPO, Reinforce)

Those that need torch are imported on first use: every env worker process imports
this package, and torch would add seconds to its start and memory to each.
"""

import importlib

from batchrl.envs import (BatchEnv, BatchVectorEnv, EnvWorker, ExternalProcess, RayEnvWorker,
                          make_vec, wrap_env)
from batchrl.envs.factory import make_batch_env

__version__ = "0.1.0"

# name -> the module that defines it (imported on first access)
_TORCH_NAMES = {
    "simulate": "batchrl.simulation",
    "flush": "batchrl.simulation",
    "evaluate_episodes": "batchrl.simulation",
    "TensorBatchEnv": "batchrl.tensor_env",
    "Algorithm": "batchrl.algos.base",
    "BatchPPO": "batchrl.algos.ppo",
    "Reinforce": "batchrl.algos.reinforce",
}

__all__ = ["BatchEnv", "BatchVectorEnv", "EnvWorker", "ExternalProcess", "RayEnvWorker",
           "make_vec", "wrap_env", "make_batch_env", *_TORCH_NAMES]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'batchrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
