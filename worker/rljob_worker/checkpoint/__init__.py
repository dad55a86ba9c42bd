"""Checkpoints: the object store, the commit protocol, the one-writer lease, and the run's save/resume face."""
