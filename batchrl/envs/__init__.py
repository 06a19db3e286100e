"""The environment layer: worker processes, batching, wrappers, device tensors."""

from batchrl.envs.batch import BatchEnv
from batchrl.envs.errors import (EnvAttributeError, EnvCrashedError, EnvError,
                                 EnvRaisedError, EnvTimeoutError, RayWorkerCrashedError)
from batchrl.envs.external import ExternalProcess
from batchrl.envs.infos import InfoList
from batchrl.envs.local import LocalWorker
from batchrl.envs.worker import RemoteAttribute, Worker, WorkerEnv
from batchrl.envs.workers import EnvWorker
from batchrl.envs.wrappers import (ClipAction, TimeLimit, convert_to_32bit, range_normalize,
                                   wrap_env)

__all__ = [
    "BatchEnv", "ExternalProcess", "Worker", "LocalWorker", "EnvWorker", "WorkerEnv", "InfoList",
    "RemoteAttribute",
    "TensorBatchEnv", "RayEnvWorker",
    "EnvError", "EnvRaisedError", "EnvAttributeError", "EnvCrashedError", "EnvTimeoutError",
    "RayWorkerCrashedError",
    "ClipAction", "TimeLimit", "convert_to_32bit", "range_normalize", "wrap_env",
]


def __getattr__(name: str):
    # TensorBatchEnv needs torch. Importing it on first use keeps torch out of
    # the env workers' fork server, which preloads batchrl.envs.external (and
    # thereby this package): importing torch there costs seconds per run.
    if name == "TensorBatchEnv":
        from batchrl.envs.tensor_env import TensorBatchEnv
        return TensorBatchEnv
    if name == "RayEnvWorker":  # Ray itself is imported only when one is built
        from batchrl.envs.ray_workers import RayEnvWorker
        return RayEnvWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
