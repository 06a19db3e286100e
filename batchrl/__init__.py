"""batchrl: batched simulation for reinforcement learning in PyTorch.

The main names are importable from here::

    from batchrl import (Simulation, simulate, BatchEnv, TensorBatchEnv, ExternalProcess,
                         EnvWorker, make_batch_env, BatchVectorEnv, Algorithm, BatchPPO,
                         Reinforce)

Those that need torch are imported on first use (``batchrl.lazy``).
"""

from batchrl.envs import (BatchEnv, BatchVectorEnv, EnvWorker, ExternalProcess, RayEnvWorker,
                          make_vec, wrap_env)
from batchrl.envs.factory import make_batch_env
from batchrl.lazy import lazy_names

__version__ = "0.1.0"

# name -> the module that defines it (imported on first access)
_TORCH_NAMES = {
    "Simulation": "batchrl.simulation",
    "simulate": "batchrl.simulation",
    "flush": "batchrl.simulation",
    "evaluate_episodes": "batchrl.simulation",
    "TensorBatchEnv": "batchrl.tensor_env",
    "Algorithm": "batchrl.algos.base",
    "BatchPPO": "batchrl.algos.ppo",
    "Reinforce": "batchrl.algos.reinforce",
    "IMPALA": "batchrl.algos.impala",
}

__all__ = ["BatchEnv", "BatchVectorEnv", "EnvWorker", "ExternalProcess", "RayEnvWorker",
           "make_vec", "wrap_env", "make_batch_env", *_TORCH_NAMES]

__getattr__, __dir__ = lazy_names(globals(), _TORCH_NAMES)
