"""The environment layer: envs in this process, in child processes or in Ray
actors, stepped in lockstep as one ``BatchEnv``. Nothing here imports torch
(the env workers' fork server preloads this package)."""

from batchrl.envs.batch import BatchEnv
from batchrl.envs.errors import (EnvAttributeError, EnvCrashedError, EnvError,
                                 EnvRaisedError, EnvTimeoutError, RayWorkerCrashedError,
                                 UnguardedMainError)
from batchrl.envs.infos import InfoList
from batchrl.envs.local import LocalWorker
from batchrl.envs.process.external import ExternalProcess
from batchrl.envs.process.main_guard import check_main_guard, main_not_reimported
from batchrl.envs.process.shared_memory import EnvWorker
from batchrl.envs.ray.worker import RayEnvWorker
from batchrl.envs.vector import BatchVectorEnv, make_vec
from batchrl.envs.worker import RemoteAttribute, Worker, WorkerEnv
from batchrl.envs.wrappers import (ClipAction, TimeLimit, convert_to_32bit, range_normalize,
                                   wrap_env)

__all__ = [
    "BatchEnv", "BatchVectorEnv", "make_vec", "Worker", "LocalWorker", "ExternalProcess",
    "EnvWorker", "RayEnvWorker",
    "WorkerEnv", "InfoList", "RemoteAttribute",
    "EnvError", "EnvRaisedError", "EnvAttributeError", "EnvCrashedError", "EnvTimeoutError",
    "RayWorkerCrashedError", "UnguardedMainError", "check_main_guard", "main_not_reimported",
    "ClipAction", "TimeLimit", "convert_to_32bit", "range_normalize", "wrap_env",
]
