"""Imported only by multiprocessing's fork server, as a preload module.

A ``kill -TERM`` to the whole process group (what a job scheduler or
``timeout`` sends) also reaches the fork server, which Python leaves at
SIGTERM's default action. Its death would take every env worker with it
(they ask the kernel to kill them when their parent, the fork server, dies),
so the trainer would see crashed envs instead of stopping cleanly. The fork
server therefore ignores SIGTERM, as the workers do; it still exits when the
process that started it does (its pipe from that process reaches EOF).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
