"""Imported only by multiprocessing's fork server, as a preload module. A ``kill -TERM`` to
the process group (a job scheduler, ``timeout``) also reaches the fork server, whose death
would kill every env worker (their parent-death signal): the trainer would see crashed envs
instead of stopping cleanly. So it ignores SIGTERM, as the workers do; it still exits when
the process that started it does (its pipe from that process closes). It ignores Ctrl-C too,
and so do the processes it starts from their first instruction: the fork server gives them
the signal handlers it had after this module, and a Ctrl-C while one still imports (before
``interrupt.start_worker`` ignores it) would kill it, a crash where the trainer stops."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
