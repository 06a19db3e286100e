"""Env workers in child processes: one env per process (``ExternalProcess``)
or several, with arrays in shared memory (``EnvWorker``)."""
