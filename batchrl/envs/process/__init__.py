"""Env workers in child processes: the pipe channel, one env per process
(``ExternalProcess``) and several envs per process with arrays in shared
memory (``EnvWorker``)."""
