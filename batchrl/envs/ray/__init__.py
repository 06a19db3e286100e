"""Env workers in Ray actors, anywhere in a Ray cluster: the worker, the
driver's connection to the cluster, and the guard of a private Ray instance.
Ray itself is imported only when a worker or a connection is made."""
