"""Tools for testing code that uses batchrl: envs that fail on demand."""
