"""Env workers in Ray actors, anywhere in a Ray cluster; Ray itself is
imported only when a worker or a connection is made."""
